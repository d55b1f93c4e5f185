"""The rows of ``attribution-eval`` and what is computed from them
(:class:`AttributionEvalResult`): the hit and curve tables, the summary, the paired
statistics (:meth:`~AttributionEvalResult.families`) and ``tables.md``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd

from ..paired import (
    OTHER_BETTER,
    REFERENCE_BETTER,
    TIE,
    holm,
    mcnemar_p,
    paired_differences,
    seeds_as_random,
)
from ..result import RowsResult, markdown_table, read_csv, shown, typed_frame, write_csv

MODES = ("comprehensiveness", "sufficiency", "insertion")
REFERENCE = "flow"
#: the methods each paired against every other ranking that ran (one Holm family each)
REFERENCES = (REFERENCE, "direct")
#: numeric columns (blank cells read back as NaN); item and tokens are ints
NUMBERS = (
    "rate", "value_full", "value", "delta", "rank", "hit1", "hit5", "rank_all", "correct",
    "seconds",
)  # fmt: skip
#: every row has every column (a CSV's header is its first row's keys)
COLUMNS = ("item", "kind", "measure", "intervention", "mode", *NUMBERS, "tokens")
#: the paired verdicts in the order tables.md counts them (better / tie / worse)
VERDICTS = (REFERENCE_BETTER, TIE, OTHER_BETTER)


def added_file(method: str) -> str:
    """The rows file of a method added to a run after it was made."""
    return f"added-{method}.csv"


class AttributionEvalResult(RowsResult):
    """Rows of an attribution evaluation, its summary and paired statistics.

    ``rows`` are the run's own (``rows.csv``), ``added`` the rows of the methods added to
    it later (``added-{method}.csv``); the tables read both (:attr:`all_rows`)."""

    ROWS: ClassVar[str] = "rows.csv"
    #: the baselines' hits on known-answer tasks (the runner's second phase)
    BASELINE_HITS: ClassVar[str] = "baseline_hits.csv"

    def __init__(
        self,
        rows: pd.DataFrame,
        config: dict[str, Any],
        run_info: dict[str, Any] | None = None,
        baseline_hits: pd.DataFrame | None = None,
        added: pd.DataFrame | None = None,
    ) -> None:
        self.baseline_hits = self.frame([]) if baseline_hits is None else baseline_hits
        self.added = self.frame([]) if added is None else added
        self.all_rows = rows if self.added.empty else pd.concat([rows, self.added],
                                                                ignore_index=True)  # fmt: skip
        super().__init__(rows, config, run_info)

    @staticmethod
    def added_methods(config: Mapping[str, Any]) -> list[str]:
        return list(config.get("added_methods") or [])

    @classmethod
    def frame(cls, rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
        return typed_frame(rows, "item", ints=("item", "tokens"), blanks=NUMBERS)

    @classmethod
    def from_rows(
        cls,
        rows: Mapping[str, Sequence[Mapping[str, Any]]],
        config: dict[str, Any],
        run_info: dict[str, Any],
    ) -> AttributionEvalResult:
        added = [r for m in cls.added_methods(config) for r in rows.get(added_file(m), [])]
        return cls(cls.frame(rows.get(cls.ROWS, [])), config, run_info,
                   cls.frame(rows.get(cls.BASELINE_HITS, [])), cls.frame(added))  # fmt: skip

    @classmethod
    def from_files(
        cls, folder: Path, config: dict[str, Any], run_info: dict[str, Any]
    ) -> AttributionEvalResult:
        """The files a run writes, read as :meth:`from_rows` reads its rows (a file not
        there: no rows)."""
        names = [cls.ROWS, cls.BASELINE_HITS, *map(added_file, cls.added_methods(config))]
        return cls.from_rows({name: read_csv(folder / name) for name in names}, config, run_info)

    def write_files(self, folder: Path) -> None:
        path = Path(folder) / self.BASELINE_HITS
        if not self.baseline_hits.empty:
            write_csv(path, self.baseline_hits)
        else:  # nor an earlier result's file left behind to be read back
            path.unlink(missing_ok=True)
        for method in self.added_methods(self.config):
            own = self.added[self.added["measure"] == method] if not self.added.empty else None
            target = Path(folder) / added_file(method)
            if own is not None and not own.empty:
                write_csv(target, own)
            else:
                target.unlink(missing_ok=True)
        super().write_files(folder)

    @property
    def _method_hits(self) -> pd.DataFrame:
        """The methods' hit rows (the run's own and the added methods')."""
        rows = self.all_rows
        return rows[rows["kind"] == "hit"] if not rows.empty else rows

    @property
    def hits(self) -> pd.DataFrame:
        """The methods' hit rows, then the baselines' (``random:SEED`` per seed) on the
        same items (an item the first phase skipped has no baseline rows either)."""
        own = self._method_hits
        if self.baseline_hits.empty:
            return own
        extra = self.baseline_hits
        if not own.empty:
            extra = extra[extra["item"].isin(set(own["item"]))]
        return pd.concat([own, extra], ignore_index=True)

    @property
    def curves(self) -> pd.DataFrame:
        rows = self.all_rows
        return rows[rows["kind"] == "curve"] if not rows.empty else rows

    def curve_table(self) -> pd.DataFrame:
        """Per (intervention, mode, rate, ranking): n, mean and s.e. of delta (random
        seeds pooled per item first)."""
        c = self.curves
        if c.empty:
            return pd.DataFrame(
                columns=["intervention", "mode", "rate", "measure", "n", "mean", "se"]
            )
        per_item = _pool_seeds(c, ["delta"], ["intervention", "mode", "rate"])
        return (
            per_item.groupby(["intervention", "mode", "rate", "measure"], sort=False)["delta"]
            .agg(n="count", mean="mean", se="sem")
            .reset_index()
        )

    def summarise_rows(self) -> pd.DataFrame:
        """One row per ranking: the area over each curve (mean delta over the rates) per
        mode and intervention, in columns ``{mode}_{intervention}`` (e.g.
        ``comprehensiveness_key_mask``), then top-1/top-5 hit rates, mean source rank and
        seconds (methods on known-answer tasks)."""
        if self.all_rows.empty:
            return pd.DataFrame(columns=["measure"])
        table = self.curve_table()
        out: dict[str, dict[str, float]] = {}
        aopc = table.groupby(["measure", "intervention", "mode"], sort=False)["mean"].mean()
        for (measure, how, mode), value in aopc.items():
            out.setdefault(str(measure), {})[f"{mode}_{how}"] = float(value)
        agg = self.hit_table()
        if not agg.empty:
            for measure, r in agg.drop(columns=["top1_se", "top5_se"]).iterrows():
                out.setdefault(str(measure), {}).update({k: float(v) for k, v in r.items()})
        frame = pd.DataFrame([{"measure": m, **v} for m, v in out.items()])
        return frame

    def hit_table(self) -> pd.DataFrame:
        """Per ranking (the index; random seeds pooled per item): n, top-1 and top-5 hit
        rates with their s.e., mean rank, ``top1_all`` and seconds per item."""
        hits = self.hits
        if hits.empty:
            return pd.DataFrame()
        hits = _pool_seeds(hits, ["hit1", "hit5", "rank", "rank_all", "seconds"])
        return hits.groupby("measure", sort=False).agg(
            n=("item", "count"), top1=("hit1", "mean"), top5=("hit5", "mean"),
            rank=("rank", "mean"), top1_all=("rank_all", _share_first),
            seconds=("seconds", "mean"), top1_se=("hit1", "sem"), top5_se=("hit5", "sem"),
        )  # fmt: skip

    def families(self, measures: Sequence[str]) -> list[tuple[str, list[str]]]:
        """The paired comparisons as Holm families, ``(reference, others)``, among the
        rankings ``measures``: flow, then ``direct``, each against the run's own rankings
        (a pair once: flow − direct sits under flow); then each method added later against
        every ranking before it. A method added to a run is a family of its own, so that
        adding it leaves the verdicts already drawn from the run as they were."""
        added_order = self.added_methods(self.config)
        if not added_order and not self.added.empty:  # a result made without its config
            added_order = list(dict.fromkeys(self.added["measure"]))
        present = list(dict.fromkeys(measures))
        added = [m for m in added_order if m in present]
        own = [m for m in present if m not in added]
        out: list[tuple[str, list[str]]] = []
        refs = [r for r in REFERENCES if r in own]
        for k, ref in enumerate(refs):
            others = [m for m in own if m != ref and m not in refs[:k]]
            if others:
                out.append((ref, others))
        for k, method in enumerate(added):
            out.append((method, own + added[:k]))
        return out

    def paired(self) -> pd.DataFrame:
        """Paired differences of delta, reference − other, per (intervention, mode, rate),
        bootstrap 95% intervals, Holm per (family, intervention, mode) (:meth:`families`:
        flow and direct against the run's rankings, a method added later against all)."""
        c = self.curves
        if c.empty:
            return pd.DataFrame()
        parts = []
        pooled = seeds_as_random(c["measure"])
        for ref, others in self.families(list(pooled)):
            rest = c[pooled.isin([ref, *others])]
            for how, g in rest.groupby("intervention", sort=False):
                frame = g.rename(columns={"item": "seq"})[
                    ["seq", "mode", "rate", "measure", "delta"]
                ]
                table = paired_differences(frame, ref, "delta")
                table.insert(0, "intervention", how)
                parts.append(table)
        return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()

    def hits_paired(self) -> pd.DataFrame:
        """Top-1 hits of each family's reference (:meth:`families`) against each other
        method's on the same items: exact McNemar, Holm over the family."""
        h = self._method_hits.dropna(subset=["hit1"])  # a baseline's hits are a floor
        if h.empty:
            return pd.DataFrame()
        table = h.pivot_table(index="item", columns="measure", values="hit1")
        parts = []
        for ref, others in self.families(list(h["measure"])):
            out = []
            for other in others:
                pair = table[[ref, other]].dropna()
                b = int(((pair[ref] == 1) & (pair[other] == 0)).sum())
                c = int(((pair[ref] == 0) & (pair[other] == 1)).sum())
                out.append(
                    {"reference": ref, "other": other, "n": len(pair), "b": b, "c": c,
                     "reference_top1": float(pair[ref].mean()),
                     "other_top1": float(pair[other].mean()), "p": mcnemar_p(b, c)}
                )  # fmt: skip
            frame = pd.DataFrame(out)
            if frame.empty:
                continue
            frame["p_holm"] = holm(frame["p"].to_numpy(float))
            frame["verdict"] = [
                TIE if not r.p_holm < 0.05 else
                (REFERENCE_BETTER if r.b > r.c else OTHER_BETTER)
                for r in frame.itertuples()
            ]  # fmt: skip
            parts.append(frame)
        return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()

    def areas(self) -> pd.DataFrame:
        """Per (ranking, intervention, mode): the area over the curve item by item (its
        delta averaged over the rates), then mean, s.e. and n over the items."""
        c = self.curves
        if c.empty:
            return pd.DataFrame(columns=["measure", "intervention", "mode", "n", "mean", "se"])
        per_item = _pool_seeds(c, ["delta"], ["intervention", "mode", "rate"])
        keys = ["measure", "intervention", "mode"]
        area = per_item.groupby([*keys, "item"], sort=False)["delta"].mean()
        return (
            area.groupby(level=keys, sort=False).agg(n="count", mean="mean", se="sem").reset_index()
        )

    def markdown(
        self, paired: pd.DataFrame | None = None, hits_paired: pd.DataFrame | None = None
    ) -> str:
        """The run's tables as Markdown (``tables.md``): hits on known-answer tasks (the
        seconds on natural text), the areas over the curves, the paired verdicts counted
        over the rates, McNemar on top-1 (:meth:`paired`, :meth:`hits_paired`, given when
        the caller has them). Rankings by their registered names."""
        paired = self.paired() if paired is None else paired
        hits_paired = self.hits_paired() if hits_paired is None else hits_paired
        cfg = self.config
        n_items = self.all_rows["item"].nunique() if not self.all_rows.empty else 0
        title = (
            f"# attribution-eval: {cfg.get('task', '?')}, {cfg.get('model', '?')}, "
            f"{n_items} items of {cfg.get('tokens', '?')} tokens"
        )
        areas = self.areas()
        columns = [(how, mode) for how in dict.fromkeys(areas["intervention"]) for mode in MODES]
        sections: list[tuple[pd.DataFrame, Callable[[pd.DataFrame], list[str]]]] = [
            (self.hit_table(), self._hits_md),
            (areas, functools.partial(self._areas_md, columns=columns)),
            (paired, functools.partial(self._verdicts_md, columns=columns)),
            (hits_paired, self._mcnemar_md),
        ]
        parts = [title, ""]
        for table, section in sections:  # an empty table has no section
            if not table.empty:
                parts += section(table)
        return "\n".join(parts)

    @staticmethod
    def _hits_md(table: pd.DataFrame) -> list[str]:
        if table["top1"].isna().all():  # natural text: no source to find, the seconds
            rows = [[str(name), str(int(r.n)), shown(r.seconds, ".3g")]
                    for name, r in table.dropna(subset=["seconds"]).iterrows()]  # fmt: skip
            head = ["method", "n", "s / item"]
            return _section("Seconds per item", "", *markdown_table(head, rows))
        table = table.sort_values("top1", ascending=False, kind="stable")
        rows = [
            [str(name), str(int(r.n)), f"{shown(r.top1)} ± {shown(r.top1_se)}",
             f"{shown(r.top5)} ± {shown(r.top5_se)}", shown(r["rank"], ".3g"),
             shown(r.top1_all), shown(r.seconds, ".3g")]
            for name, r in table.iterrows()
        ]  # fmt: skip
        head = ["ranking", "n", "top-1", "top-5", "mean rank", "top1_all", "s / item"]
        return _section(
            "Hits: the known source first (top-1) or among the first five (top-5)",
            "Rates ± s.e. over the items; mean rank of the source among the candidates; "
            "`top1_all`: first among all positions, token 0 competing; seconds per item.",
            *markdown_table(head, rows),
        )

    @staticmethod
    def _areas_md(areas: pd.DataFrame, columns: list[tuple[str, str]]) -> list[str]:
        cell = {(r.measure, r.intervention, r.mode): r for r in areas.itertuples()}
        best = {}
        for how, mode in columns:
            means = areas[(areas["intervention"] == how) & (areas["mode"] == mode)]["mean"]
            best[(how, mode)] = means.max() if mode == "comprehensiveness" else means.min()
        rows = []
        for name in dict.fromkeys(areas["measure"]):
            cells = [str(name)]
            for how, mode in columns:
                r = cell.get((name, how, mode))
                text = "" if r is None else f"{r.mean:.2f} ± {shown(r.se)}"
                cells.append(
                    f"**{text}**" if r is not None and r.mean == best[(how, mode)] else text
                )
            rows.append(cells)
        return _section(
            "Areas over the curves",
            "delta = log P(answer | full) − log P(answer | edited), averaged over the rates "
            "item by item; mean ± s.e. over the items. Comprehensiveness: higher is more "
            "faithful; sufficiency and insertion: lower is. Bold: the best mean of a column "
            "(not a test; the verdicts are below).",
            *markdown_table(["ranking", *(f"{m} ({h})" for h, m in columns)], rows),
        )

    @staticmethod
    def _verdicts_md(paired: pd.DataFrame, columns: list[tuple[str, str]]) -> list[str]:
        out: list[str] = []
        for ref, group in paired.groupby("reference", sort=False):
            rows = []
            for other, g in group.groupby("other", sort=False):
                cells = [str(other)]
                for how, mode in columns:
                    v = g[(g["intervention"] == how) & (g["mode"] == mode)]["verdict"]
                    counts = [int((v == k).sum()) for k in VERDICTS]
                    cells.append(" / ".join(map(str, counts)) if len(v) else "")
                rows.append(cells)
            head = ["other", *(f"{m} ({h})" for h, m in columns)]
            out += [f"**{ref}** against", "", *markdown_table(head, rows)]
        return _section(
            "Paired verdicts on the curves",
            "Reference − other per rate (`paired.csv`: bootstrap 95% intervals, Holm over each "
            "reference's family): *better / tie / worse* for the reference, counted over the "
            "rates.",
            *out,
        )

    @staticmethod
    def _mcnemar_md(mcnemar: pd.DataFrame) -> list[str]:
        rows = [
            [r.reference, r.other, str(r.n), str(r.b), str(r.c),
             f"{r.reference_top1:.2f} / {r.other_top1:.2f}", f"{r.p_holm:.2g}", r.verdict]
            for r in mcnemar.itertuples()
        ]  # fmt: skip
        head = ["reference", "other", "n", "only the reference", "only the other",
                "top-1 (reference / other)", "p (Holm)", "verdict"]  # fmt: skip
        return _section(
            "Top-1 hits, paired (exact McNemar, Holm over each reference's family)",
            "",
            *markdown_table(head, rows, align="llrrrrrl"),
        )

    def write_summary(self, folder: Path) -> None:
        """The summary, the curves, the paired statistics and ``tables.md`` (written when
        a run ends)."""
        super().write_summary(folder)
        paired, hits = self.paired(), self.hits_paired()  # each once: the bootstrap is dear
        write_csv(Path(folder) / "curves.csv", self.curve_table())
        write_csv(Path(folder) / "paired.csv", paired)
        (Path(folder) / "tables.md").write_text(self.markdown(paired, hits) + "\n")
        path = Path(folder) / "hits_paired.csv"
        if not hits.empty:  # known-answer tasks with flow (the deletion task has no hits)
            write_csv(path, hits)
        else:  # nor an empty or earlier version's table left behind
            path.unlink(missing_ok=True)


def _section(title: str, note: str, *lines: str) -> list[str]:
    """A section of ``tables.md``: its heading, its note where it has one (each followed
    by a blank line), then its lines (tables, each ending in a blank line)."""
    return [f"## {title}", "", *([note, ""] if note else []), *lines]


def _pool_seeds(rows: pd.DataFrame, values: list[str], keys: Sequence[str] = ()) -> pd.DataFrame:
    """``rows`` with the random seeds' rows (``random:SEED``) averaged per item into one
    ``random`` row (per ``keys``); other rankings' rows as they are (one per item and key)."""
    pooled = rows.assign(measure=seeds_as_random(rows["measure"]))
    return pooled.groupby([*keys, "measure", "item"], sort=False, as_index=False)[values].mean()


def _share_first(ranks: pd.Series) -> float:
    """The share of items whose known answer ranks first; NaN where no item has a known
    answer (the deletion task), as ``hit1``'s mean is."""
    known = ranks.dropna()
    return float((known == 1).mean()) if len(known) else math.nan
