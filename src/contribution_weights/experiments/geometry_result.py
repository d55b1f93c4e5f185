"""The result of the geometry analyses: tidy tables, and their JSON form (``tables.json``).

:class:`GeometryResult` holds one pandas table (or small dataclass) per analysis; fields
of analyses that were not run are None. :meth:`GeometryResult.to_json` gives the dict
written to ``tables.json`` with exactly the keys ``regression_r2``,
``log_regression_r2``, ``correlations``, ``first_token_weight``, ``entropy``,
``sink_alignment``, ``sink_scaling``, ``norm_fit``, ``semantic_cone``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from .regression import regression_table
from .stats import GROUPS, LOG_NAMES, WEIGHT_MEASURES

if TYPE_CHECKING:
    from .geometry import GeometryAccumulator

JSON_KEYS = (
    "regression_r2",
    "log_regression_r2",
    "correlations",
    "first_token_weight",
    "entropy",
    "sink_alignment",
    "sink_scaling",
    "norm_fit",
    "semantic_cone",
)
SCALING_COLUMNS = ("gamma", "ppl_mean", "ppl_se", "nll_mean", "nll_se", "ppl_of_mean_nll", "n")


@dataclass
class SinkScalingResult:
    """Perplexity against the sink-value scale γ (Figure 6c)."""

    layers: list[int]
    table: pd.DataFrame  # gamma, ppl_mean, ppl_se, nll_mean, nll_se, ppl_of_mean_nll, n
    skipped: str | None = None  # why the passes did not run (no sink layer); table empty

    def to_json(self) -> dict[str, Any]:
        return {"layers": self.layers, "by_gamma": _records(self.table), "skipped": self.skipped}


@dataclass
class GeometryResult:
    """Every analysis' table; None for analyses not run."""

    sequences: int
    num_layers: int
    sink_rate: pd.DataFrame  # per layer: sink_rate (mean α_i0)
    regression_r2: pd.DataFrame | None = None  # index features, columns all/first/tail
    log_regression_r2: pd.DataFrame | None = None
    points: dict[str, int] = field(default_factory=dict)  # sampled points per group
    correlations: pd.DataFrame | None = None  # 3×3, group "all"
    correlations_by_group: dict[str, pd.DataFrame] | None = None
    first_token_weight_by_layer: pd.DataFrame | None = None
    entropy: pd.DataFrame | None = None  # index all/excluding_first
    entropy_by_layer: pd.DataFrame | None = None
    sink_alignment: pd.DataFrame | None = None  # per layer sink_tail, tail_tail
    sink_scaling: SinkScalingResult | None = None
    norm_fit: pd.DataFrame | None = None  # per head
    norm_points: dict[tuple[int, int], np.ndarray] | None = None  # (alpha, norm2) samples
    semantic_cone: pd.DataFrame | None = None  # per layer fractions
    cone_snapshot: dict[str, Any] | None = None
    joint: pd.DataFrame | None = None

    @property
    def first_token_weight(self) -> dict[str, float] | None:
        """Table 4: the mean over layers of the per-layer first-token weight."""
        if self.first_token_weight_by_layer is None:
            return None
        return {m: _num(self.first_token_weight_by_layer[m].mean()) for m in WEIGHT_MEASURES}

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {key: None for key in JSON_KEYS}
        if self.regression_r2 is not None and self.log_regression_r2 is not None:
            out["regression_r2"] = _nested(self.regression_r2)
            out["log_regression_r2"] = _nested(self.log_regression_r2)
        if self.correlations_by_group is not None:
            out["correlations"] = {g: _nested(t) for g, t in self.correlations_by_group.items()}
        if self.first_token_weight is not None:
            out["first_token_weight"] = self.first_token_weight
        if self.entropy is not None:
            out["entropy"] = {
                row: {m: _num(self.entropy.loc[row, m]) for m in WEIGHT_MEASURES}
                for row in ("all", "excluding_first")
            }
        if self.sink_alignment is not None:
            t = self.sink_alignment
            out["sink_alignment"] = {
                "mean": {c: _num(t[c].mean()) for c in ("sink_tail", "tail_tail")},
                "by_layer": _records(t.reset_index()),
            }
        if self.sink_scaling is not None:
            out["sink_scaling"] = self.sink_scaling.to_json()
        if self.norm_fit is not None:
            out["norm_fit"] = {
                "summary": norm_fit_summary(self.norm_fit),
                "heads": _records(self.norm_fit),
            }
        if self.semantic_cone is not None:
            c = self.semantic_cone
            out["semantic_cone"] = {
                "overall": _records(c[c.index == "all"])[0] if "all" in c.index else None,
                "by_layer": _records(c[c.index != "all"].reset_index()),
            }
        return out


def norm_fit_summary(t: pd.DataFrame) -> dict[str, Any]:
    if t.empty:
        return {"heads": 0}
    return {
        "heads": len(t),
        "fraction_convex_min_below_1": _num(t["convex_min_below_1"].mean()),
        "fraction_gamma_prime_negative": _num((t["gamma_prime"] < 0).mean()),
        "median_alpha_min": _num(t["alpha_min"].median()),
        "median_r2": _num(t["r2"].median()),
    }


def _num(x: Any) -> Any:
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    x = float(x)
    return None if math.isnan(x) or math.isinf(x) else x


def _records(t: pd.DataFrame) -> list[dict[str, Any]]:
    return [{str(k): _num(v) for k, v in row.items()} for row in t.to_dict("records")]


def _nested(t: pd.DataFrame) -> dict[str, dict[str, Any]]:
    return {str(c): {str(i): _num(t.loc[i, c]) for i in t.index} for c in t.columns}


def build_result(acc: GeometryAccumulator) -> GeometryResult:
    """Turn an accumulator's running statistics into tables."""
    from .sinks import NormFit, SemanticCone
    from .stats import (
        ComponentPoints,
        Entropy,
        FirstTokenWeight,
        LogCorrelations,
        SinkAlignment,
        SinkRate,
    )

    s, o, layers = acc.stats, acc.options, pd.RangeIndex(acc.num_layers, name="layer")
    rate = s["sink_rate"]
    assert isinstance(rate, SinkRate)
    res = GeometryResult(
        acc.sequences, acc.num_layers, pd.DataFrame(rate.by_layer(), layers, ["sink_rate"])
    )
    pts = s.get("points")
    if isinstance(pts, ComponentPoints):
        groups = {g: pts.group(g) for g in GROUPS}
        res.points = {g: len(cols["alpha"]) for g, cols in groups.items()}
        if "regression" in acc.analyses:
            lin = {g: regression_table(c, False, o.folds, o.seed) for g, c in groups.items()}
            log = {g: regression_table(c, True, o.folds, o.seed) for g, c in groups.items()}
            res.regression_r2 = pd.DataFrame(lin).rename_axis("features")
            res.log_regression_r2 = pd.DataFrame(log).rename_axis("features")
        if "joint_distributions" in acc.analyses:
            res.joint = pd.DataFrame({k: v for k, v in groups["all"].items() if k != "c"})
    corr = s.get("correlations")
    if isinstance(corr, LogCorrelations):
        res.correlations_by_group = {
            g: pd.DataFrame(m.correlation(), LOG_NAMES, LOG_NAMES).assign(n=m.n)
            for g, m in corr.moments.items()
        }
        res.correlations = res.correlations_by_group["all"].drop(columns="n")
    ftw = s.get("first_token_weight")
    if isinstance(ftw, FirstTokenWeight):
        res.first_token_weight_by_layer = pd.DataFrame(ftw.by_layer(), layers, list(ftw.columns))
    ent = s.get("entropy")
    if isinstance(ent, Entropy):
        by_layer = pd.DataFrame(ent.by_layer(), layers, list(ent.columns))
        res.entropy_by_layer = by_layer
        means = by_layer.mean()
        res.entropy = pd.DataFrame(
            {m: [means[f"{m}:all"], means[f"{m}:excluding_first"]] for m in WEIGHT_MEASURES},
            index=["all", "excluding_first"],
        )
    align = s.get("sink_alignment")
    if isinstance(align, SinkAlignment):
        res.sink_alignment = pd.DataFrame(align.by_layer(), layers, list(align.columns))
    if "sink_scaling" in acc.analyses and acc.scaling_skipped:
        empty = pd.DataFrame(columns=[*SCALING_COLUMNS])
        res.sink_scaling = SinkScalingResult([], empty, acc.scaling_skipped)
    elif "sink_scaling" in acc.analyses and acc.scaling_nll:  # NaN rows: too short
        res.sink_scaling = _scaling(
            acc.sink_layers or [], list(o.gammas), np.array(acc.scaling_nll)
        )
    fit = s.get("norm_fit")
    if isinstance(fit, NormFit):
        res.norm_fit = pd.DataFrame(fit.fit())
        res.norm_points = {
            (i, h): r.rows.numpy()
            for i, row in enumerate(fit.points)
            for h, r in enumerate(row)
            if len(r)
        }
    cone = s.get("semantic_cone")
    if isinstance(cone, SemanticCone):
        cols = [
            "low_inside_with_sink",
            "low_inside_without_sink",
            "all_inside_with_sink",
            "all_inside_without_sink",
        ]
        table = pd.DataFrame(cone.fractions(), pd.Index(range(acc.num_layers), name="layer"), cols)
        total = cone.counts.sum(0)
        with np.errstate(invalid="ignore", divide="ignore"):
            overall = [
                total[1] / total[0],
                total[2] / total[0],
                total[4] / total[3],
                total[5] / total[3],
            ]
        table.index = table.index.astype(object)
        table.loc["all"] = overall
        table["low_norm_outputs"] = [int(x) for x in [*cone.counts[:, 0], total[0]]]
        res.semantic_cone = table
        res.cone_snapshot = dict(cone.snapshot)
    return res


def _scaling(layers: list[int], gammas: list[float], nll: np.ndarray) -> SinkScalingResult:
    """``nll (n_sequences, n_gammas)`` → mean ± standard error of PPL and NLL per γ.

    Sequences too short to score (NaN rows) are left out.
    """
    nll = nll[~np.isnan(nll).any(1)].reshape(-1, len(gammas))
    n = nll.shape[0]
    if n == 0:
        nll = np.full((1, len(gammas)), np.nan)
    ppl = np.exp(nll)

    def se(x: np.ndarray) -> np.ndarray:
        return x.std(0, ddof=1) / math.sqrt(n) if n > 1 else np.full(x.shape[1], np.nan)

    table = pd.DataFrame(
        {
            "gamma": gammas,
            "ppl_mean": ppl.mean(0),
            "ppl_se": se(ppl),
            "nll_mean": nll.mean(0),
            "nll_se": se(nll),
            "ppl_of_mean_nll": np.exp(nll.mean(0)),
            "n": n,
        }
    )
    return SinkScalingResult(layers, table)
