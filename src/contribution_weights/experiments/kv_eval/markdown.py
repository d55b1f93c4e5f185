"""``tables.md`` of a kv-eval run: its tables (:mod:`.tables`) as Markdown, one section per
task (and RULER setting), the settings compared last."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from ..paired import TIE
from ..result import markdown_table, shown
from .options import METRIC, NO_COMPRESSION
from .tables import BETTER, HIGHER_IS_BETTER, TEST, WORSE


def tables_markdown(
    config: Mapping[str, Any],
    summary: pd.DataFrame,
    ranking: pd.DataFrame,
    versus: pd.DataFrame,
    settings: pd.DataFrame,
) -> str:
    """``tables.md`` (:meth:`~.result.KVEvalResult.markdown`): per task (and RULER
    setting) of the run's ``summary`` the uncompressed metric, each method's mean ± s.e.
    per ratio (ordered by the first ratio, best first) with the methods it beats / loses
    to over the ratios (``ranking``), the methods decided against the uncompressed cache
    (``versus``), the cost; then the settings compared (``settings``)."""
    task = config["task"]
    metric = METRIC[task]
    higher = HIGHER_IS_BETTER[metric]
    parts = [
        f"# kv-eval: {task}, {config.get('model', '?')}",
        "",
        f"{metric} ({'higher' if higher else 'lower'} is better): mean ± s.e. over the "
        "items per ratio of the cache evicted; wins / losses: the other methods a "
        "method beats / loses to item by item (Holm per ratio), summed over the ratios.",
        "",
    ]
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


def _decided_line(what: str, frame: pd.DataFrame, metric: str) -> str:
    """One sentence on a table of tested differences of ``metric``
    (:func:`~.tables.uncompressed_pairs`, :func:`~.tables.setting_pairs`): the decided
    ones, worse and better, else the largest tie."""
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
