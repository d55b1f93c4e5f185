"""kv-eval's tables from its per-item rows: means and standard errors per method and ratio
(and RULER task, setting, depth), each item against its own uncompressed score, every
pair of methods tested item by item and the ranking from those tests, each method against
the uncompressed cache, query-aware against query-agnostic, and the cost columns.

The tests and their corrections are :mod:`..paired`'s; here is what kv-eval compares.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import pandas as pd

from ...defaults import RULER_TASKS
from ..paired import (
    OTHER_BETTER,
    REFERENCE_BETTER,
    TIE,
    difference_stats,
    holm,
    paired_differences,
    ranking_table,
    verdict,
)
from .options import METRIC, NO_COMPRESSION

#: is a larger value of the task's metric better? And the paired test of two methods: the
#: t-test for NLL, the exact sign test (McNemar's for 0/1) for accuracies, which take few
#: values per item
HIGHER_IS_BETTER = {"nll": False, "accuracy": True}
TEST = {"nll": "t", "accuracy": "sign"}
#: per-row cost columns (rows of runs before they existed lack them)
COST_COLUMNS = ("compress_s", "kept_mib")


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
    0.05 and the interval excludes 0 (:mod:`..paired`; a lower NLL or a higher accuracy
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


def _with_costs(out: pd.DataFrame, per_item: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """``out`` with the mean of each cost column over the same groups, where rows have it."""
    have = [c for c in COST_COLUMNS if c in per_item.columns]
    if not have:
        return out
    means = per_item.groupby(keys, sort=False)[have].mean().reset_index()
    return out.merge(means, on=keys, how="left")
