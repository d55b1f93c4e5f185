"""What a kv-eval run gives: :class:`KVEvalResult` (its per-item rows, the tables from them,
runs of other methods on the same items joined as one, save and load) and the lines said
after its summary (:func:`shortfall`)."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..paired import OTHER_BETTER, REFERENCE_BETTER, TIE, difference_stats, holm, verdict
from ..result import SUMMARY as SUMMARY  # re-exported: the summary file
from ..result import RowsResult, rows_named, write_csv
from ..runner import csv_bytes, rows_so_far
from . import tables
from .markdown import tables_markdown
from .options import METRIC, NO_COMPRESSION

PER_ITEM = "per_item.csv"
SUMMARY_DEPTH = "summary_depth.csv"
SUMMARY_PAIRED = "summary_paired.csv"
SUMMARY_PAIRS = "summary_pairs.csv"
SUMMARY_RANKING = "summary_ranking.csv"
SUMMARY_VERSUS = "summary_vs_uncompressed.csv"
SUMMARY_SETTINGS = "summary_settings.csv"
#: a RULER-like task whose uncompressed accuracy is below this is one the model cannot do
CANNOT_DO = 0.1


class KVEvalResult(RowsResult):
    """Per-item rows, their summaries, the run's configuration and run_info."""

    ROWS = PER_ITEM

    per_item = rows_named(
        "One row per (item, method, ratio): the task's metric and the kept first token."
    )

    def summarise_rows(self) -> pd.DataFrame:
        if self.config["task"] == "ruler":
            return tables.ruler_summary(self.rows)
        return tables.summarise(self.rows, self.config["task"])

    @classmethod
    def frame(cls, rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
        return _typed(pd.DataFrame(list(rows)))

    def by_depth(self) -> pd.DataFrame:
        """Passkey accuracy per (method, ratio, depth); ruler: per (task, setting, method,
        ratio, depth of the asked needle), the needle tasks only."""
        if self.config["task"] == "ruler":
            return tables.ruler_summary(self.per_item.dropna(subset=["depth"]), by=("depth",))
        return tables.summarise(self.per_item, self.config["task"], by=("depth",))

    def paired(self) -> pd.DataFrame:
        """Each item's metric minus its own uncompressed one, mean and standard error per
        (method, ratio): ``method, task, ratio, n, delta_mean, delta_se``. Differences on
        the same item and continuation separate methods far better than the raw means,
        whose spread is mostly how hard each text is."""
        return tables.paired_summary(self.per_item, self.config["task"])

    def pairs(self) -> pd.DataFrame:
        """Every pair of compression methods on the same items, per ratio (and per RULER
        task and setting): see :func:`~.tables.method_pairs`."""
        return tables.method_pairs(self.per_item, self.config["task"])

    def versus_uncompressed(self) -> pd.DataFrame:
        """Each method and ratio against the uncompressed cache on the same items, tested
        (:func:`~.tables.uncompressed_pairs`)."""
        return tables.uncompressed_pairs(self.per_item, self.config["task"])

    def settings(self) -> pd.DataFrame:
        """RULER with both settings: query-aware − query-agnostic per task, method and
        ratio, tested (:func:`~.tables.setting_pairs`)."""
        return (
            tables.setting_pairs(self.per_item)
            if self.config["task"] == "ruler"
            else pd.DataFrame()
        )

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
        higher = tables.HIGHER_IS_BETTER[metric]
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
                n, mean, se, low, high, p = difference_stats(d, tables.TEST[metric])
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
        return tables.method_ranking(self.per_item, self.config["task"], pairs)

    def markdown(
        self,
        ranking: pd.DataFrame | None = None,
        versus: pd.DataFrame | None = None,
        settings: pd.DataFrame | None = None,
    ) -> str:
        """The run's tables as Markdown (``tables.md``, :func:`~.markdown.tables_markdown`):
        the summary, :meth:`ranking`, :meth:`versus_uncompressed` and :meth:`settings`
        (the last three given when the caller has them)."""
        ranking = self.ranking() if ranking is None else ranking
        versus = self.versus_uncompressed() if versus is None else versus
        settings = self.settings() if settings is None else settings
        return tables_markdown(self.config, self.summary, ranking, versus, settings)

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
    data-parallel run is still going (:func:`~..runner.rows_so_far`)."""
    rows = rows_so_far(folder, PER_ITEM, "item")
    if not rows:
        raise FileNotFoundError(f"{folder} holds no {PER_ITEM} yet: no item has finished")
    return pd.read_csv(io.BytesIO(csv_bytes(rows)))


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
