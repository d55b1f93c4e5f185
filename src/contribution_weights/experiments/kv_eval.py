"""``cw kv-eval``: KV-cache compression methods against ratio, on LM, passkey and RULER-like
long-context tasks.

Per item, one scored prefill (:func:`~contribution_weights.kv.prefill`) serves every
method and ratio; each (method, ratio) is a copy of the cache compressed and evaluated by
the task (:mod:`contribution_weights.kv.evaluate`). Ratio 0 (no compression) is evaluated
once per item, under the method name ``none``. An item is one unit of the experiment
runner (:mod:`.runner`): its rows are appended to ``per_item.csv`` as it finishes, so an
interrupted run resumes where it stopped, ``run_info.json`` (versions, ``finished``,
``seconds`` added up over resumed sessions) is written when a session ends, and under
``accelerate launch`` the items are dealt over the processes.

The ``ruler`` task (:mod:`contribution_weights.kv.ruler`) makes ``n`` items of each of
``ruler_tasks``; an item is prefilled once per setting (``query_agnostic``: the context;
``query_aware``: the context and the question) and yields a row per (setting, method,
ratio), its ``task`` the RULER-like task's name. Its summary adds, to every row, the
accuracy of the same task and setting uncompressed (``uncompressed_accuracy``).
"""

from __future__ import annotations

import contextlib
import io
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from ..defaults import KV_RATIOS, KV_TASKS, RULER_TASKS  # light: the CLI shows them first
from ..kv import CompressedCache, compress, prefill
from ..kv.cache import stackable
from ..kv.evaluate import lm_item, lm_items, lm_score, passkey_items, passkey_score
from ..kv.ruler import RulerItem, ruler_items, ruler_scores
from ..loading import LoadedModel
from ..runs import fingerprint
from .options import KVEvalOptions
from .paired import (
    OTHER_BETTER,
    REFERENCE_BETTER,
    TIE,
    difference_stats,
    holm,
    paired_differences,
    ranking_table,
    verdict,
)
from .result import SUMMARY as SUMMARY  # re-exported: the summary file
from .result import RowsResult, markdown_table, shown, warn_few_samples, write_csv
from .runner import Experiment, Phase, csv_bytes, rows_so_far, run_experiment

TASKS = KV_TASKS
METRIC = {"lm": "nll", "passkey": "accuracy", "ruler": "accuracy"}
DEFAULT_RATIOS = KV_RATIOS
PER_ITEM = "per_item.csv"
SUMMARY_DEPTH = "summary_depth.csv"
SUMMARY_PAIRED = "summary_paired.csv"
SUMMARY_PAIRS = "summary_pairs.csv"
SUMMARY_RANKING = "summary_ranking.csv"
SUMMARY_VERSUS = "summary_vs_uncompressed.csv"
SUMMARY_SETTINGS = "summary_settings.csv"
#: is a larger value of the task's metric better? And the paired test of two methods: the
#: t-test for NLL, the exact sign test (McNemar's for 0/1) for accuracies, which take few
#: values per item
HIGHER_IS_BETTER = {"nll": False, "accuracy": True}
TEST = {"nll": "t", "accuracy": "sign"}
NO_COMPRESSION = "none"
#: a RULER-like task whose uncompressed accuracy is below this is one the model cannot do
CANNOT_DO = 0.1


class KVEvalResult(RowsResult):
    """Per-item rows, their summaries, the run's configuration and run_info."""

    ROWS = PER_ITEM

    @property
    def per_item(self) -> pd.DataFrame:
        """One row per (item, method, ratio): the task's metric and the kept first token."""
        return self.rows

    def summarise_rows(self) -> pd.DataFrame:
        if self.config["task"] == "ruler":
            return ruler_summary(self.rows)
        return summarise(self.rows, self.config["task"])

    @classmethod
    def frame(cls, rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
        return _typed(pd.DataFrame(list(rows)))

    def by_depth(self) -> pd.DataFrame:
        """Passkey accuracy per (method, ratio, depth); ruler: per (task, setting, method,
        ratio, depth of the asked needle), the needle tasks only."""
        if self.config["task"] == "ruler":
            return ruler_summary(self.per_item.dropna(subset=["depth"]), by=("depth",))
        return summarise(self.per_item, self.config["task"], by=("depth",))

    def paired(self) -> pd.DataFrame:
        """Each item's metric minus its own uncompressed one, mean and standard error per
        (method, ratio): ``method, task, ratio, n, delta_mean, delta_se``. Differences on
        the same item and continuation separate methods far better than the raw means,
        whose spread is mostly how hard each text is."""
        return paired_summary(self.per_item, self.config["task"])

    def pairs(self) -> pd.DataFrame:
        """Every pair of compression methods on the same items, per ratio (and per RULER
        task and setting): see :func:`method_pairs`."""
        return method_pairs(self.per_item, self.config["task"])

    def versus_uncompressed(self) -> pd.DataFrame:
        """Each method and ratio against the uncompressed cache on the same items, tested
        (:func:`uncompressed_pairs`)."""
        return uncompressed_pairs(self.per_item, self.config["task"])

    def settings(self) -> pd.DataFrame:
        """RULER with both settings: query-aware − query-agnostic per task, method and
        ratio, tested (:func:`setting_pairs`)."""
        return setting_pairs(self.per_item) if self.config["task"] == "ruler" else pd.DataFrame()

    def join(self, *others: KVEvalResult) -> KVEvalResult:
        """One result from runs of other methods on the same items, as if one run had run
        them all: its tables then test every method against every other item by item.

        The runs must share the model, data, task, context length, window, seed and (RULER)
        settings; RULER items are matched by task and number within the task (they are
        generated from those and the seed), so runs of different task lists join on their
        common tasks, and runs of different ``n`` on their common items. Their uncompressed
        rows must agree item by item (else the items differ, and the join is refused). A
        (method, ratio) already in this result keeps this result's rows. The items kept are
        those every run has finished, numbered as one run of the common tasks would."""
        same = ("task", "model", "texts_sha256", "context_tokens", "seed", "settings", "window")
        runs = [self, *others]
        for other in others:
            differ = [k for k in same if self.config.get(k) != other.config.get(k)]
            if differ:
                raise ValueError(
                    f"cannot join runs whose {', '.join(differ)} differ; run the methods "
                    "with the same model, data and options (--methods, --ruler-tasks, --n and "
                    "--ratios may differ)"
                )
        numbered = [run._numbered() for run in runs]
        for theirs in numbered[1:]:
            _check_same_items(numbered[0], theirs, self.config["task"])
        keep = set.intersection(*(set(r["_key"]) for r in numbered))
        rows, methods = [numbered[0]], list(self.config["methods"])
        seen = set(zip(numbered[0]["method"], numbered[0]["ratio"], strict=True))
        for other, theirs in zip(others, numbered[1:], strict=True):
            pairs = pd.Series(list(zip(theirs["method"], theirs["ratio"], strict=True)))
            new = ~pairs.isin(seen).to_numpy() & (theirs["method"] != NO_COMPRESSION).to_numpy()
            rows.append(theirs[new])
            seen |= set(pairs[new])
            methods += [m for m in other.config["methods"] if m not in methods]
        joined = pd.concat(rows, ignore_index=True)
        joined = joined[joined["_key"].isin(keep)]
        config = {**self.config, "methods": methods, "n": min(r.config["n"] for r in runs)}
        if self.config["task"] == "ruler":
            tasks = [t for t in self.config["ruler_tasks"]
                     if all(t in o.config["ruler_tasks"] for o in others)]  # fmt: skip
            config["ruler_tasks"] = tasks
            number = {k: tasks.index(k[0]) * config["n"] + k[1] for k in keep}
        else:
            number = {k: k[1] for k in keep}
        joined = joined.assign(item=joined["_key"].map(number)).drop(columns="_key")
        joined = joined.sort_values("item", kind="stable").reset_index(drop=True)
        info = {**self.run_info, "joined": [o.config.get("methods") for o in others]}
        return KVEvalResult(joined, config, info)

    def _numbered(self) -> pd.DataFrame:
        """The rows with ``_key``: (task, number within the task), which the items are
        generated from (a RULER run numbers its items over all its tasks in turn)."""
        rows = self.per_item
        if self.config["task"] != "ruler":
            return rows.assign(_key=list(zip([""] * len(rows), rows["item"], strict=True)))
        n, tasks = self.config["n"], list(self.config["ruler_tasks"])
        within = rows["item"] - rows["task"].map(tasks.index) * n
        return rows.assign(_key=list(zip(rows["task"], within, strict=True)))

    def versus(self, pairs: Sequence[tuple[str, str]]) -> pd.DataFrame:
        """Planned comparisons: each ``(method, base)`` pair per ratio (and RULER task and
        setting), d = metric(method) − metric(base) item by item, with the n, mean, s.e.,
        bootstrap interval, p of :meth:`pairs`' test, the items where the method is
        better, worse and the same (for accuracies), and Holm over all the comparisons of
        the table; the verdict is ``method better``, ``base better`` or ``tie``."""
        metric = METRIC[self.config["task"]]
        higher = HIGHER_IS_BETTER[metric]
        known = set(self.per_item["method"]) - {NO_COMPRESSION}
        if any(NO_COMPRESSION in pair for pair in pairs):
            raise ValueError("for methods against no compression, use versus_uncompressed()")
        missing = sorted({m for pair in pairs for m in pair} - known)
        if missing:
            raise ValueError(f"not in this result: {', '.join(missing)}; it has {sorted(known)}")
        ruler = self.config["task"] == "ruler"
        groups = ["task", "setting", "ratio"] if ruler else ["ratio"]
        rows = self.per_item[self.per_item["method"] != NO_COMPRESSION]
        out = []
        for key, frame in rows.groupby(groups, sort=True):
            values = frame.pivot_table(index="item", columns="method", values=metric)
            for method, base in pairs:
                if method not in values or base not in values:
                    continue  # one of them was not run at this ratio
                d = (values[method] - values[base]).dropna().to_numpy(float)
                n, mean, se, low, high, p = difference_stats(d, TEST[metric])
                keys = dict(zip(groups, key if isinstance(key, tuple) else (key,), strict=True))
                out.append({**keys, "method": method, "base": base, "n": n, "mean": mean,
                            "se": se, "ci_low": low, "ci_high": high, "p": p,
                            "better": int((d > 0).sum() if higher else (d < 0).sum()),
                            "worse": int((d < 0).sum() if higher else (d > 0).sum()),
                            "same": int((d == 0).sum())})  # fmt: skip
        table = pd.DataFrame(out)
        if table.empty:
            return table
        table["p_holm"] = holm(table["p"].to_numpy())
        table["verdict"] = [
            {REFERENCE_BETTER: "method better", OTHER_BETTER: "base better", TIE: TIE}[
                verdict(r.mean, r.p_holm, not (r.ci_low <= 0 <= r.ci_high), higher)
            ]
            for r in table.itertuples()
        ]
        return table

    def ranking(self, pairs: pd.DataFrame | None = None) -> pd.DataFrame:
        """Per ratio (and RULER task and setting) and method: n, mean, s.e. and how many
        other methods it beats, loses to and ties with by the verdicts of
        :meth:`pairs` (``pairs``, that table when the caller has it)."""
        return method_ranking(self.per_item, self.config["task"], pairs)

    def markdown(
        self,
        ranking: pd.DataFrame | None = None,
        versus: pd.DataFrame | None = None,
        settings: pd.DataFrame | None = None,
    ) -> str:
        """The run's tables as Markdown (``tables.md``): per task (and RULER setting) the
        uncompressed metric, each method's mean ± s.e. per ratio (ordered by the first
        ratio, best first) with the methods it beats / loses to over the ratios, the
        methods decided against the uncompressed cache, the cost; then the settings
        compared (:meth:`ranking`, :meth:`versus_uncompressed`, :meth:`settings`, given
        when the caller has them)."""
        task = self.config["task"]
        metric = METRIC[task]
        higher = HIGHER_IS_BETTER[metric]
        ranking = self.ranking() if ranking is None else ranking
        versus = self.versus_uncompressed() if versus is None else versus
        settings = self.settings() if settings is None else settings
        parts = [
            f"# kv-eval: {task}, {self.config.get('model', '?')}",
            "",
            f"{metric} ({'higher' if higher else 'lower'} is better): mean ± s.e. over the "
            "items per ratio of the cache evicted; wins / losses: the other methods a "
            "method beats / loses to item by item (Holm per ratio), summed over the ratios.",
            "",
        ]
        summary = self.summary
        if summary.empty:
            return "\n".join([*parts, "No complete item yet."])
        if "setting" not in summary:
            summary = summary.assign(setting="")
        summary = summary.fillna({"setting": ""})
        ranking = ranking.assign(setting="") if "setting" not in ranking else ranking
        ranking = ranking.fillna({"setting": ""})
        versus = versus.fillna({"setting": ""})
        fmt = f".{2 if metric == 'accuracy' else 3}f"
        for (name, setting), mine in summary.groupby(["task", "setting"], sort=False):
            parts += [f"## {name}" + (f", {setting}" if setting else ""), ""]
            plain = mine[mine["method"] == NO_COMPRESSION]
            if not plain.empty:
                r = plain.iloc[0]
                mean, se = shown(r[f"{metric}_mean"], fmt), shown(r[f"{metric}_se"], fmt)
                parts += [f"Uncompressed: {mean} ± {se} (n = {int(r.n)}).", ""]
            g = ranking[(ranking["task"] == name) & (ranking["setting"] == setting)]
            if g.empty:
                continue
            ratios = sorted(g["ratio"].unique())
            cell = {(r.method, r.ratio): r for r in g.itertuples()}
            table = []
            for method in _best_first(g, higher):
                mine_rows = [cell[(method, x)] for x in ratios if (method, x) in cell]
                cells = [
                    f"{shown(cell[(method, x)].mean, fmt)} ± {shown(cell[(method, x)].se, fmt)}"
                    if (method, x) in cell else ""
                    for x in ratios
                ]  # fmt: skip
                wins = sum(int(r.wins) for r in mine_rows)
                losses = sum(int(r.losses) for r in mine_rows)
                table.append([f"`{method}`", *cells, f"{wins} / {losses}"])
            head = ["method", *(f"{x:g}" for x in ratios), "wins / losses"]
            parts += markdown_table(head, table)
            if not versus.empty:
                mine_versus = versus[(versus["task"] == name) & (versus["setting"] == setting)]
                line = _decided_line("Against the uncompressed cache", mine_versus, metric)
                parts += [line, ""]
            if "kept_mib" in mine and "compress_s" in mine:
                parts += [_cost_line(mine, ratios), ""]
        for name, g in settings.groupby("task", sort=False) if not settings.empty else ():
            line = _decided_line("The question in the observation window", g, "accuracy")
            parts += [f"## {name}: query-aware − query-agnostic", "", line, ""]
        return "\n".join(parts)

    def write_summary(self, folder: Path) -> None:
        """``summary.csv``, ``summary_paired.csv``, ``summary_pairs.csv``,
        ``summary_ranking.csv`` (and ``summary_depth.csv`` for passkey and ruler) and
        ``tables.md``; the runner's hook at the end of a run."""
        super().write_summary(folder)
        write_csv(Path(folder) / SUMMARY_PAIRED, self.paired())
        pairs = self.pairs()
        write_csv(Path(folder) / SUMMARY_PAIRS, pairs)
        ranking = self.ranking(pairs)
        write_csv(Path(folder) / SUMMARY_RANKING, ranking)
        versus, settings = self.versus_uncompressed(), self.settings()
        write_csv(Path(folder) / SUMMARY_VERSUS, versus)
        if not settings.empty:
            write_csv(Path(folder) / SUMMARY_SETTINGS, settings)
        (Path(folder) / "tables.md").write_text(self.markdown(ranking, versus, settings) + "\n")
        if self.config["task"] in ("passkey", "ruler"):
            write_csv(Path(folder) / SUMMARY_DEPTH, self.by_depth())

    @classmethod
    def from_files(
        cls, folder: Path, config: dict[str, Any], run_info: dict[str, Any]
    ) -> KVEvalResult:
        """The complete items written so far: of a finished or an interrupted run, and of
        one still running under ``accelerate launch``, whose processes write their items to
        ``parts/<rank>/`` until the end of the run merges them."""
        per_item = _read_per_item(folder)
        rows_per_item = per_item.groupby("item").size()
        complete = rows_per_item[rows_per_item == rows_per_item.max()].index
        rows = per_item[per_item["item"].isin(complete)].reset_index(drop=True)
        return cls(rows, config, run_info)


def _check_same_items(mine: pd.DataFrame, theirs: pd.DataFrame, task: str) -> None:
    """Refuse a join whose uncompressed rows (of two runs' :meth:`KVEvalResult._numbered`
    rows) differ on a common item: the text columns compared as text (a CSV reads an empty
    output back as missing, a number-like one as a number), the numbers to 1e-6 relative
    (another device or library may round the last digits differently)."""
    index = ["_key", "setting"] if task == "ruler" else ["_key"]
    numbers = [c for c in ("nll", "accuracy", "answer_nll") if c in mine.columns]
    texts = [c for c in ("output", "answers", "answer") if c in mine.columns]

    def base(rows: pd.DataFrame) -> pd.DataFrame:
        rows = rows[rows["method"] == NO_COMPRESSION].set_index(index)
        return rows[[c for c in numbers + texts if c in rows.columns]]

    a, b = base(mine), base(theirs)
    if a.empty or b.empty:
        raise ValueError(
            "a run to join has no uncompressed rows to show that the items are the same: "
            "run each with ratio 0 among --ratios"
        )
    common = a.index.intersection(b.index)
    if common.empty:
        raise ValueError("the runs have no item in common: nothing to join")
    a, b = a.loc[common].sort_index(), b.loc[common].sort_index()
    same = pd.Series(True, index=a.index)
    for col in a.columns.intersection(b.columns):
        if col in numbers:
            x, y = a[col].to_numpy(float), b[col].to_numpy(float)
            same &= np.isclose(x, y, rtol=1e-6, atol=1e-9) | (np.isnan(x) & np.isnan(y))
        else:
            same &= a[col].fillna("").astype(str) == b[col].fillna("").astype(str)
    if not same.all():
        raise ValueError(
            f"the uncompressed rows differ on {int((~same).sum())} of {len(common)} common "
            "items: the runs did not see the same items (another model, data set or "
            "generator version?)"
        )


def _read_per_item(folder: Path) -> pd.DataFrame:
    """``per_item.csv`` of a run folder, with the items its processes' parts hold while a
    data-parallel run is still going (:func:`~.runner.rows_so_far`)."""
    rows = rows_so_far(folder, PER_ITEM, "item")
    if not rows:
        raise FileNotFoundError(f"{folder} holds no {PER_ITEM} yet: no item has finished")
    return pd.read_csv(io.BytesIO(csv_bytes(rows)))


def _decided_line(what: str, frame: pd.DataFrame, metric: str) -> str:
    """One sentence on a table of tested differences of ``metric`` (:func:`uncompressed_pairs`,
    :func:`setting_pairs`): the decided ones, worse and better, else the largest tie."""
    fmt = f".{2 if metric == 'accuracy' else 3}f"

    def said(r: Any) -> str:
        signed = f"+{fmt}"
        return (f"`{r.method}` at {r.ratio:g} ({shown(r.mean, signed)} "
                f"[{shown(r.ci_low, signed)}, {shown(r.ci_high, signed)}], "
                f"Holm p = {shown(r.p_holm, '.2g')})")  # fmt: skip

    test = "sign test" if TEST[metric] == "sign" else "t-test"
    how = f"{what} ({test}, Holm over methods × ratios)"
    worse = [said(r) for r in frame.itertuples() if r.verdict == WORSE]
    better = [said(r) for r in frame.itertuples() if r.verdict == BETTER]
    if len(worse) + len(better) > 12:  # most are decided: count them, name the ties
        ties = [f"`{r.method}` at {r.ratio:g}" for r in frame.itertuples() if r.verdict == TIE]
        return (f"{how}: of {len(frame)} (method, ratio) cases {len(worse)} worse, "
                f"{len(better)} better, ties: {', '.join(ties) or 'none'}.")  # fmt: skip
    if worse or better:
        return (f"{how}: worse {'; '.join(worse) or 'nowhere'}; "
                f"better {'; '.join(better) or 'nowhere'}.")  # fmt: skip
    ties = frame.dropna(subset=["mean"])
    if ties.empty:
        return f"{how}: nothing to compare."
    largest = next(ties.loc[[ties["mean"].abs().idxmax()]].itertuples())
    return f"{how}: every difference a tie (the largest: {said(largest)})."


def _best_first(ranking: pd.DataFrame, higher: bool) -> list[str]:
    """The methods of one table (``ranking``'s rows of one task and setting), best first at
    the smallest ratio each has, then by name; a method whose mean is undefined last."""
    firsts = ranking.sort_values("ratio").groupby("method", sort=False)["mean"].first()

    def key(method: str) -> tuple[float, str]:
        mean = float(firsts[method])
        return (float("inf") if mean != mean else -mean if higher else mean, method)

    return sorted(firsts.index, key=key)


def _cost_line(summary: pd.DataFrame, ratios: Sequence[float]) -> str:
    """What the methods keep and spend per ratio (means over items; a range over methods)."""

    def span(values: pd.Series, fmt: str) -> str:
        low, high = format(values.min(), fmt), format(values.max(), fmt)
        return low if low == high else f"{low}-{high}"

    plain = summary[summary["method"] == NO_COMPRESSION]
    parts = []
    for ratio in ratios:
        g = summary[(summary["ratio"] == ratio) & (summary["method"] != NO_COMPRESSION)]
        if not g.empty:
            parts.append(
                f"{ratio:g}: {span(g['kept_mib'], '.1f')} MiB kept, "
                f"{span(g['compress_s'], '.2f')} s to score and evict"
            )
    kept = f" (uncompressed {plain['kept_mib'].mean():.1f} MiB)" if not plain.empty else ""
    return "Cost per ratio (means over items, the range over methods): " + "; ".join(parts) + kept


def summarise(per_item: pd.DataFrame, task: str, by: Sequence[str] = ()) -> pd.DataFrame:
    """Mean and standard error over items per (method, ratio[, by…])."""
    metric = METRIC[task]
    cols = ["method", "task", "ratio", *by, "n", f"{metric}_mean", f"{metric}_se"]
    if per_item.empty:
        return pd.DataFrame(columns=cols)
    g = per_item.groupby(["method", "ratio", *by], sort=False)
    out = g.agg(
        n=(metric, "size"), **{f"{metric}_mean": (metric, "mean"), f"{metric}_se": (metric, "sem")}
    ).reset_index()
    out["task"] = task
    out = out.sort_values(["ratio", "method", *by], kind="stable")[cols].reset_index(drop=True)
    return _with_costs(out, per_item, ["method", "ratio", *by])


def _versus_uncompressed(per_item: pd.DataFrame, task: str) -> pd.DataFrame:
    """``per_item`` with ``task`` and ``setting`` filled in (``""`` outside RULER) and
    ``delta``: the metric minus the same item's uncompressed metric in the same task and
    setting; rows without an uncompressed row are left out."""
    metric = METRIC[task]
    rows = per_item.assign(
        task=per_item.get("task", task),
        setting=per_item["setting"].fillna("") if "setting" in per_item else "",
    )
    keys = ["task", "setting", "item"]
    base = rows[rows["method"] == NO_COMPRESSION].set_index(keys)[metric].astype(float)
    own = base.reindex(pd.MultiIndex.from_frame(rows[keys])).to_numpy(dtype=float)
    return rows.assign(delta=rows[metric].astype(float) - own).dropna(subset=["delta"])


def paired_summary(per_item: pd.DataFrame, task: str) -> pd.DataFrame:
    """Per (method, ratio): mean and s.e. over items of the metric minus the same item's
    uncompressed metric (items without an uncompressed row are left out). Ruler: per
    (task, setting, method, ratio), each item against its own uncompressed row in the
    same setting."""
    ruler = task == "ruler"
    cols = ["method", "task", *(["setting"] if ruler else []), "ratio", "n", "delta_mean",
            "delta_se"]  # fmt: skip
    if per_item.empty or NO_COMPRESSION not in set(per_item["method"]):
        return pd.DataFrame(columns=cols)
    frame = _versus_uncompressed(per_item, task)
    groups = ["task", "setting", "method", "ratio"] if ruler else ["method", "ratio"]
    g = frame.groupby(groups, sort=False)["delta"]
    out = g.agg(n="size", delta_mean="mean", delta_se="sem").reset_index()
    out["delta_se"] = out["delta_se"].fillna(0.0)
    if ruler:
        return _ruler_order(out)[cols]
    out["task"] = task
    return out.sort_values(["ratio", "method"], kind="stable")[cols].reset_index(drop=True)


#: a method's (or setting's) paired verdict against its baseline: the uncompressed cache
#: (:func:`uncompressed_pairs`), query-agnostic (:func:`setting_pairs`)
BETTER, WORSE = "better", "worse"
VERSUS_COLUMNS = ["task", "setting", "method", "ratio", "n", "mean", "ci_low", "ci_high", "p",
                  "p_holm", "verdict"]  # fmt: skip
SETTINGS_COLUMNS = ["task", "method", "ratio", "n", "mean", "ci_low", "ci_high", "p", "p_holm",
                    "verdict"]  # fmt: skip


def _decided(frame: pd.DataFrame, family: Sequence[str], metric: str) -> pd.DataFrame:
    """``frame`` (one row per comparison: ``d``, the paired differences, an array) with the
    test (:data:`TEST` for ``metric``), a 95% bootstrap interval, Holm per ``family`` and
    the verdict (better / worse / tie, from the side the differences are taken)."""
    stats = [difference_stats(d, TEST[metric]) for d in frame["d"]]
    columns = ["n", "mean", "se", "ci_low", "ci_high", "p"]
    frame = frame.drop(columns=["d"]).join(pd.DataFrame(stats, columns=columns, index=frame.index))
    frame["p_holm"] = math.nan
    for _, g in frame.groupby(list(family), sort=False):
        frame.loc[g.index, "p_holm"] = holm(g["p"].to_numpy(float))
    higher = HIGHER_IS_BETTER[metric]
    side = {REFERENCE_BETTER: BETTER, OTHER_BETTER: WORSE, TIE: TIE}
    frame["verdict"] = [
        side[verdict(r.mean, r.p_holm, bool(r.ci_low > 0 or r.ci_high < 0), higher)]
        for r in frame.itertuples()
    ]
    return frame


def uncompressed_pairs(per_item: pd.DataFrame, task: str) -> pd.DataFrame:
    """Each method and ratio against the uncompressed cache on the same items (and RULER
    setting): method − uncompressed, bootstrap interval, the paired test of the metric
    (sign test for accuracy, t-test for NLL), Holm over methods × ratios per task and
    setting; ``better`` / ``worse`` / ``tie`` for the method (:data:`VERSUS_COLUMNS`)."""
    if per_item.empty or NO_COMPRESSION not in set(per_item["method"]):
        return pd.DataFrame(columns=VERSUS_COLUMNS)
    rows = _versus_uncompressed(per_item, task)
    out = []
    for (name, setting), g in rows.groupby(["task", "setting"], sort=False):
        for (method, ratio), h in g[g["method"] != NO_COMPRESSION].groupby(
            ["method", "ratio"], sort=False
        ):
            out.append({"task": name, "setting": setting, "method": method, "ratio": ratio,
                        "d": h["delta"].to_numpy(dtype=float)})  # fmt: skip
    if not out:
        return pd.DataFrame(columns=VERSUS_COLUMNS)
    return _decided(pd.DataFrame(out), ["task", "setting"], METRIC[task])[VERSUS_COLUMNS]


def setting_pairs(per_item: pd.DataFrame) -> pd.DataFrame:
    """RULER with both settings: per task, method and ratio, query-aware − query-agnostic
    on the same items (the uncompressed cache too), as :func:`uncompressed_pairs` tests
    them; Holm over methods × ratios per task; ``better`` when query-aware is
    (:data:`SETTINGS_COLUMNS`)."""
    settings = {"query_agnostic", "query_aware"}
    if per_item.empty or not settings <= set(per_item.get("setting", ())):
        return pd.DataFrame(columns=SETTINGS_COLUMNS)
    out = []
    for (name, method, ratio), g in per_item.groupby(["task", "method", "ratio"], sort=False):
        wide = g.pivot_table(index="item", columns="setting", values="accuracy")
        if not settings <= set(wide.columns):
            continue
        d = (wide["query_aware"] - wide["query_agnostic"]).dropna().to_numpy(float)
        out.append({"task": name, "method": method, "ratio": ratio, "d": d})
    if not out:
        return pd.DataFrame(columns=SETTINGS_COLUMNS)
    return _decided(pd.DataFrame(out), ["task"], "accuracy")[SETTINGS_COLUMNS]


PAIRS_COLUMNS = [
    "task", "setting", "ratio", "reference", "other", "n", "mean", "se", "ci_low",
    "ci_high", "p", "p_holm", "verdict",
]  # fmt: skip
RANKING_COLUMNS = [
    "task", "setting", "ratio", "method", "n", "mean", "se", "wins", "losses", "ties",
]  # fmt: skip


def _families(per_item: pd.DataFrame, task: str) -> Iterator[tuple[str, str, pd.DataFrame]]:
    """(task, setting, rows in the paired tests' shape) per table of one Holm family: each
    RULER task and setting, or the whole run. The compressed rows only (ratio > 0): the
    uncompressed reference is one row per item, not a method to rank."""
    rows = per_item[per_item["method"] != NO_COMPRESSION]
    metric = METRIC[task]
    if rows.empty:
        return
    groups = rows.groupby(["task", "setting"], sort=False) if task == "ruler" else [
        ((task, ""), rows)]  # fmt: skip
    for (name, setting), g in groups:
        frame = g.rename(columns={"item": "seq", "method": "measure", "ratio": "rate"})
        frame = frame.assign(mode=metric)[["seq", "mode", "rate", "measure", metric]]
        yield str(name), str(setting), frame


def method_pairs(per_item: pd.DataFrame, task: str) -> pd.DataFrame:
    """Every pair of methods on the same items (:data:`PAIRS_COLUMNS`): per ratio, d =
    metric(reference) − metric(other) item by item, its mean, s.e., percentile-bootstrap
    95% interval and p (the paired t-test for NLL, the exact sign test for accuracy:
    :data:`TEST`), Holm-corrected over every ratio × pair of one table
    (a RULER task and setting, or the whole run), and the verdict: "tie" unless p_holm <
    0.05 and the interval excludes 0 (:mod:`.paired`; a lower NLL or a higher accuracy
    is better). ``setting`` is empty outside RULER."""
    metric = METRIC[task]
    parts = []
    for name, setting, frame in _families(per_item, task):
        table = paired_differences(
            frame, None, metric, higher_is_better=HIGHER_IS_BETTER[metric], test=TEST[metric]
        )
        parts.append(table.assign(task=name, setting=setting).rename(columns={"rate": "ratio"}))
    if not parts:
        return pd.DataFrame(columns=PAIRS_COLUMNS)
    return pd.concat(parts, ignore_index=True)[PAIRS_COLUMNS]


def method_ranking(
    per_item: pd.DataFrame, task: str, pairs: pd.DataFrame | None = None
) -> pd.DataFrame:
    """Per ratio (and RULER task and setting) and method (:data:`RANKING_COLUMNS`): n, the
    mean and s.e. of the metric over items, and the methods it beats (``wins``), loses to
    and ties with by the verdicts of :func:`method_pairs` (``pairs``, that table)."""
    metric = METRIC[task]
    pairs = method_pairs(per_item, task) if pairs is None else pairs
    parts = []
    # "" outside RULER reads back from the CSV as NaN
    settings = pairs["setting"].astype(object).where(pairs["setting"].notna(), "").astype(str)
    for name, setting, frame in _families(per_item, task):
        own = pairs[(pairs["task"] == name) & (settings == setting)]
        own = own.rename(columns={"ratio": "rate"}).assign(mode=metric)
        table = ranking_table(frame, metric, pairs=own)
        parts.append(
            table.assign(task=name, setting=setting).rename(
                columns={"rate": "ratio", "ranking": "method"}
            )
        )
    if not parts:
        return pd.DataFrame(columns=RANKING_COLUMNS)
    return pd.concat(parts, ignore_index=True)[RANKING_COLUMNS]


def ruler_summary(per_item: pd.DataFrame, by: Sequence[str] = ()) -> pd.DataFrame:
    """Mean and standard error of the accuracy per (task, setting, method, ratio[, by…]),
    and on every row the accuracy of the same task and setting (and ``by``) uncompressed:
    a task the model cannot do uncompressed reads as such beside every method."""
    keys = ["task", "setting", *by]
    cols = ["method", "task", "setting", "ratio", *by, "n", "accuracy_mean", "accuracy_se",
            "uncompressed_accuracy"]  # fmt: skip
    if per_item.empty:
        return pd.DataFrame(columns=cols)
    g = per_item.groupby([*keys, "method", "ratio"], sort=False)["accuracy"]
    out = g.agg(n="size", accuracy_mean="mean", accuracy_se="sem").reset_index()
    base = out[out["method"] == NO_COMPRESSION].set_index(keys)["accuracy_mean"]
    index = pd.MultiIndex.from_frame(out[keys])
    out["uncompressed_accuracy"] = base.reindex(index).to_numpy(dtype=float)
    return _with_costs(_ruler_order(out, by)[cols], per_item, [*keys, "method", "ratio"])


def _ruler_order(frame: pd.DataFrame, by: Sequence[str] = ()) -> pd.DataFrame:
    """Rows in RULER_TASKS' order, then setting, ratio, method (and ``by``)."""
    rank = {t: k for k, t in enumerate(RULER_TASKS)}
    frame = frame.assign(_rank=frame["task"].map(rank))
    order = ["_rank", "setting", "ratio", "method", *by]
    return frame.sort_values(order, kind="stable").drop(columns="_rank").reset_index(drop=True)


def _items(model: LoadedModel, opts: KVEvalOptions, texts: Sequence[str] | None) -> Iterator[Any]:
    if opts.task == "passkey":
        yield from passkey_items(model, opts.context_tokens, opts.n, opts.seed)
    elif opts.task == "ruler":
        assert isinstance(opts.ruler_tasks, list)
        yield from ruler_items(
            model, opts.ruler_tasks, opts.context_tokens, opts.n, opts.seed, texts
        )
    else:
        assert texts is not None
        for ids in lm_items(model, texts, opts.context_tokens, opts.n):
            yield lm_item(ids, opts.context_tokens)


#: per-row cost columns (rows of runs before they existed lack them)
COST_COLUMNS = ("compress_s", "kept_mib")


def cost(small: CompressedCache, seconds: float) -> dict[str, float]:
    """What a compression costs: ``compress_s``, the seconds to score and evict (the
    prefill that gathered the statistics is shared by every method and counted apart, as
    ``prefill_s``), and ``kept_mib``, the MiB of keys and values the compressed layers
    store (padded slots of head-adaptive methods included)."""
    stored = 0
    for idx, kept in small.kept.items():  # the cache may since hold continuation tokens too
        layer = small.cache.layers[idx]
        for x in (layer.keys, layer.values):
            stored += x[..., : kept.shape[-1], :].numel() * x.element_size()
    return {"compress_s": round(seconds, 4), "kept_mib": round(stored / 2**20, 4)}


def _with_costs(out: pd.DataFrame, per_item: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """``out`` with the mean of each cost column over the same groups, where rows have it."""
    have = [c for c in COST_COLUMNS if c in per_item.columns]
    if not have:
        return out
    means = per_item.groupby(keys, sort=False)[have].mean().reset_index()
    return out.merge(means, on=keys, how="left")


def first_token_kept(kept: dict[int, torch.Tensor]) -> float:
    """Fraction of (layer, KV head) kept sets that hold position 0 (the usual sink)."""
    flags = [(k == 0).any(-1).float().mean() for k in kept.values()]
    return round(float(torch.stack(flags).mean()), 4) if flags else 1.0


def item_rows(model: LoadedModel, item: Any, opts: KVEvalOptions) -> list[dict[str, Any]]:
    """One row per (method, ratio) configuration of one item (ruler: per (setting, method,
    ratio))."""
    if opts.task == "ruler":
        return ruler_rows(model, item, opts)
    context = item.context if opts.task == "passkey" else item[0]
    started = time.perf_counter()
    pre = prefill(model, context, opts.window, seed=opts.seed, methods=opts.methods)
    prefill_s = time.perf_counter() - started
    rows = []
    for method, ratio in opts.configurations():
        started = time.perf_counter()
        small = compress(pre, "h2o" if method == NO_COMPRESSION else method, ratio)
        spent = time.perf_counter() - started
        if opts.task == "passkey":
            scores = passkey_score(model, small, item)
            extra = {"depth": item.depth}
        else:
            scores = lm_score(model, small, item[1])
            extra = {}
        rows.append(
            {
                "method": method,
                "ratio": ratio,
                **extra,
                **scores,
                "first_token_kept": first_token_kept(small.kept),
                "prefill_s": round(prefill_s, 3),
                **cost(small, spent),
            }
        )
    return rows


#: (method, ratio) configurations of one ruler item generated together, as the rows of one
#: batch (same ratio, equal counts per head): each generated token then reads the model's
#: weights once for all of them. Memory: at most this many compressed caches are held (the
#: largest group generates when they are that many), besides the prefill's cache.
GENERATE_BATCH = 12


def ruler_rows(model: LoadedModel, item: RulerItem, opts: KVEvalOptions) -> list[dict[str, Any]]:
    """Per setting one prefill (the context, or the context and the question), then per
    (method, ratio) a compressed copy, greedy generation and RULER's score. Configurations
    whose caches stack (:func:`~..kv.cache.stackable`: the same ratio, no head-adaptive
    padding) generate together, up to :data:`GENERATE_BATCH` at a time; rows come out in
    the order of :meth:`KVEvalOptions.configurations`."""
    return [row for setting in opts.settings for row in _setting_rows(model, item, opts, setting)]


def _setting_rows(
    model: LoadedModel, item: RulerItem, opts: KVEvalOptions, setting: str
) -> list[dict[str, Any]]:
    ids = item.prefill_ids(setting)
    started = time.perf_counter()
    pre = prefill(model, ids, opts.window, seed=opts.seed, methods=opts.methods)
    prefill_s = time.perf_counter() - started
    configs = opts.configurations()
    done: dict[int, dict[str, Any]] = {}
    pending: dict[Any, list[tuple[int, CompressedCache, float]]] = {}

    def flush(key: Any) -> None:
        group = pending.pop(key)
        scores = ruler_scores(model, [small for _, small, _ in group], item, setting)
        for (k, small, spent), score in zip(group, scores, strict=True):
            method, ratio = configs[k]
            done[k] = {
                "setting": setting,
                "method": method,
                "ratio": ratio,
                "depth": item.meta.get("depth", float("nan")),
                "accuracy": score["accuracy"],
                "answers": "|".join(item.answers),
                "output": score["output"].replace("\n", "\\n"),  # one CSV line
                "first_token_kept": first_token_kept(small.kept),
                "prefill_tokens": int(ids.shape[1]),
                "prefill_s": round(prefill_s, 3),
                **cost(small, spent),
            }

    for k, (method, ratio) in enumerate(configs):
        started = time.perf_counter()
        small = compress(pre, "h2o" if method == NO_COMPRESSION else method, ratio)
        spent = time.perf_counter() - started
        key = stackable(small)
        key = ("alone", k) if key is None else key
        pending.setdefault(key, []).append((k, small, spent))
        if key[0] == "alone" or len(pending[key]) >= GENERATE_BATCH:
            flush(key)
        elif sum(map(len, pending.values())) >= GENERATE_BATCH:  # bound what is held
            flush(max(pending, key=lambda g: len(pending[g])))
    for key in list(pending):
        flush(key)
    return [done[k] for k in range(len(configs))]


class KVEval(Experiment["KVEvalResult"]):
    """The kv-eval experiment for the runner: one unit per item (prefill once, then every
    (method, ratio) configuration), its rows to ``per_item.csv``."""

    name = "kv-eval"

    def __init__(
        self,
        model: LoadedModel,
        texts: Sequence[str] | None,
        opts: KVEvalOptions,
        source: str | None = None,
    ) -> None:
        self.model, self.opts = model, opts
        self.items = list(_items(model, opts, texts))  # at most n items: tokens only
        self._config = {
            "experiment": "kv-eval",
            "model": model.name,
            **opts.to_dict(),
            "texts_sha256": fingerprint(texts or []),
            "source": source or opts.task,
        }

    def config(self) -> dict[str, Any]:
        return self._config

    def phases(self) -> Iterator[Phase]:
        yield Phase(
            name="kv-eval",
            units=range(len(self.items)),
            run=self._item,
            rows_file=PER_ITEM,
            key="item",
            rows_per_unit=len(self.opts.configurations())
            * (len(self.opts.settings) if self.opts.task == "ruler" else 1),
        )

    def _item(self, i: int) -> list[dict[str, Any]]:
        item = self.items[i]
        rows = item_rows(self.model, item, self.opts)
        task = item.task if isinstance(item, RulerItem) else self.opts.task
        return [{"item": i, "task": task, **r} for r in rows]

    def result(
        self, rows: Mapping[str, list[dict[str, str]]], run_info: dict[str, Any]
    ) -> KVEvalResult:
        config = {
            **self._config,
            "items_available": len(self.items),
            "seconds": run_info["seconds"],
        }
        return KVEvalResult.from_rows(rows, config, run_info)


def _typed(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows as read back from the CSV (strings) with numeric columns as numbers, in item
    order; the same types :meth:`KVEvalResult.load` gets from ``pd.read_csv``."""
    for col in frame.columns:
        with contextlib.suppress(ValueError, TypeError):
            frame[col] = pd.to_numeric(frame[col])
    if frame.empty:
        return frame
    frame["ratio"] = frame["ratio"].astype(float)
    return frame.sort_values(["item"], kind="stable").reset_index(drop=True)


def shortfall(result: KVEvalResult) -> list[str]:
    """A line saying the texts ran out, when a language-modelling run got fewer items than
    asked for (each item needs ``context_tokens + 129`` tokens of consecutive texts); for
    ruler, a line per (task, setting) the model cannot do uncompressed (accuracy below
    :data:`CANNOT_DO`), whose compressed scores say nothing about the methods."""
    c = result.config
    if c["task"] == "ruler":
        return cannot_do(result.summary, int(c["context_tokens"]))
    done = int(result.summary["n"].max()) if not result.summary.empty else 0
    if c["task"] != "lm" or done >= int(c["n"]):
        return []
    need = int(c["context_tokens"]) + 129
    return [f"only {done} of {c['n']} items: the texts ran out (each needs {need} tokens)"]


def cannot_do(summary: pd.DataFrame, context_tokens: int) -> list[str]:
    """Lines naming the (task, setting) pairs whose uncompressed accuracy is below
    :data:`CANNOT_DO` in a ruler summary."""
    base = summary[summary["method"] == NO_COMPRESSION]
    return [
        f"{r.task} ({r.setting}): uncompressed accuracy {r.accuracy_mean:.2f} at "
        f"{context_tokens} tokens: the model cannot do this task, so its compressed scores "
        "do not compare the methods"
        for r in base.itertuples()
        if r.accuracy_mean < CANNOT_DO
    ]


def kv_eval(
    model: LoadedModel,
    texts: Sequence[str] | None = None,
    *,
    options: KVEvalOptions | None = None,
    out: str | Path | None = None,
    resume: bool = False,
    source: str | None = None,
    progress: bool = True,
) -> KVEvalResult:
    """Evaluate KV-cache compression methods (see the module docstring and ``cw kv-eval``).

    ``texts`` (for the ``lm`` task) are running texts; consecutive ones are joined until
    an item has ``context_tokens + 129`` tokens. The ``passkey`` task needs no texts; the
    ``ruler`` task's needle tasks take their haystack from them (FineWeb-Edu).
    Resumable in ``out`` and data parallel under ``accelerate launch``, like every
    experiment of the runner.
    """
    opts = options or KVEvalOptions()
    if opts.task == "lm" and not texts:
        raise ValueError("the lm task needs texts: pass --dataset or --texts")
    if opts.task == "ruler" and not texts and set(opts.ruler_tasks) - {"cwe", "fwe"}:
        raise ValueError(
            "the ruler tasks take their haystack from texts: pass FineWeb-Edu texts "
            "(cw.data.load_texts('fineweb-edu'); the CLI reads them from --data-dir)"
        )
    experiment = KVEval(model, texts, opts, source)
    se = "nll_se, delta_se" if opts.task == "lm" else "accuracy_se"
    warn_few_samples(len(experiment.items), "item", se)
    return run_experiment(experiment, out, resume=resume, progress=progress)
