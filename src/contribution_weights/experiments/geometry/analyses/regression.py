"""Component regressions (paper Tables 1 and 3, method §5): held-out R² of ĉ on its parts.

Pure numpy on sampled points ``(α, r, κ, ĉ)``. Each regression is ordinary least squares
with an intercept; its score is the mean over ``folds`` folds of the R² on the held-out
fold, ``1 − SSE/SST`` with SST taken about the held-out fold's own mean (so a useless
regressor scores about 0, and may score slightly below).

Feature sets:

* linear (Table 1): ĉ on a single regressor, one of α, r, κ or a pairwise product
  α·r, α·κ, r·κ (``ĉ = α·r·κ`` exactly, so each product leaves one factor out);
* log (Table 3): log|ĉ| on log α, log r, log|κ| singly and on two of them jointly
  (points where any factor is 0 are left out: the log is undefined there).

The points are the shared sample (:class:`~..stats.ComponentPoints`, ``"points"``), per
token group: all j, j = 0, j ≥ 1.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from ...options import GeometryOptions
from ...stats import Stat
from ..analysis import (
    Analysis,
    from_nested,
    markdown_table,
    nested,
    register_analysis,
    sampled_points,
)
from ..analysis_types import ResultView, SavedRun, TableContext

Columns = Mapping[str, np.ndarray]
FeatureFn = Callable[[Columns], list[np.ndarray]]

LINEAR_FEATURES: dict[str, FeatureFn] = {
    "alpha": lambda c: [c["alpha"]],
    "r": lambda c: [c["r"]],
    "kappa": lambda c: [c["kappa"]],
    "alpha*r": lambda c: [c["alpha"] * c["r"]],
    "alpha*kappa": lambda c: [c["alpha"] * c["kappa"]],
    "r*kappa": lambda c: [c["r"] * c["kappa"]],
}

LOG_FEATURES: dict[str, FeatureFn] = {
    "log_alpha": lambda c: [c["log_alpha"]],
    "log_r": lambda c: [c["log_r"]],
    "log_kappa": lambda c: [c["log_kappa"]],
    "log_alpha+log_r": lambda c: [c["log_alpha"], c["log_r"]],
    "log_alpha+log_kappa": lambda c: [c["log_alpha"], c["log_kappa"]],
    "log_r+log_kappa": lambda c: [c["log_r"], c["log_kappa"]],
}


def fold_indices(n: int, folds: int, seed: int = 0) -> list[np.ndarray]:
    """A random partition of ``range(n)`` into ``folds`` nearly equal parts."""
    perm = np.random.default_rng(seed).permutation(n)
    return [np.sort(part) for part in np.array_split(perm, folds)]


def cv_r2(
    x: np.ndarray,
    y: np.ndarray,
    folds: int = 5,
    seed: int = 0,
    parts: list[np.ndarray] | None = None,
) -> float:
    """Mean held-out R² of OLS (with intercept) of ``y (n,)`` on ``x (n, k)``.

    Computed from per-fold sufficient statistics (the cross-products of [1, x, y]), so
    the data are read once whatever the number of folds. NaN with fewer than
    ``2 * folds`` points. ``parts`` are the folds' indices when the caller already has
    them (:func:`fold_indices` of ``len(y)``, shared by every fit on the same points).
    """
    y = np.asarray(y, dtype=np.float64)
    n = len(y)
    if n < 2 * folds:
        return float("nan")
    if parts is None:
        parts = fold_indices(n, folds, seed)
    x = np.asarray(x, dtype=np.float64).reshape(n, -1)
    z = np.column_stack([np.ones(n), x, y])  # (n, k + 2)
    k = z.shape[1] - 1
    stats = []
    for test in parts:
        zt = z[test]
        stats.append(zt.T @ zt)
    total = np.sum(stats, axis=0)
    scores = []
    for s_test in stats:
        s_train = total - s_test
        coef = np.linalg.lstsq(s_train[:k, :k], s_train[:k, k], rcond=None)[0]
        m = s_test[0, 0]
        sse = s_test[k, k] - 2 * coef @ s_test[:k, k] + coef @ s_test[:k, :k] @ coef
        sst = s_test[k, k] - s_test[0, k] ** 2 / m
        scores.append(1.0 - sse / sst if sst > 0 else (1.0 if sse <= 0 else 0.0))
    return float(np.mean(scores))


def log_columns(cols: Columns) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Logs of the components where all are non-zero: (``log_*`` columns, log|ĉ|)."""
    a, r, k = (np.asarray(cols[n], np.float64) for n in ("alpha", "r", "kappa"))
    ok = (a > 0) & (r > 0) & (k != 0)
    logs = {"log_alpha": np.log(a[ok]), "log_r": np.log(r[ok]), "log_kappa": np.log(np.abs(k[ok]))}
    c = np.asarray(cols["c"], np.float64)[ok]
    return logs, np.log(np.abs(c), out=np.full_like(c, -np.inf), where=c != 0)


def regression_table(
    cols: Columns, log: bool = False, folds: int = 5, seed: int = 0
) -> dict[str, float]:
    """Held-out R² of every feature set (Table 1, or Table 3 with ``log``)."""
    if log:
        feats, y = log_columns(cols)
        finite = np.isfinite(y)
        feats = {k: v[finite] for k, v in feats.items()}
        y = y[finite]
        table = LOG_FEATURES
    else:
        feats = {k: np.asarray(cols[k], np.float64) for k in ("alpha", "r", "kappa")}
        y = np.asarray(cols["c"], np.float64)
        table = LINEAR_FEATURES
    # every feature set is fitted on the same points: one fold partition for all of them
    parts = fold_indices(len(y), folds, seed) if len(y) >= 2 * folds else None
    return {
        name: cv_r2(
            np.column_stack(fn(feats)) if len(y) else np.empty((0, 1)), y, folds, seed, parts
        )
        for name, fn in table.items()
    }


def regression_tables(
    groups: Mapping[str, Columns], folds: int = 5, seed: int = 0
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """Tables 1 and 3 for every token group: ``({group: linear R²}, {group: log R²})``."""
    lin = {g: regression_table(c, False, folds, seed) for g, c in groups.items()}
    log = {g: regression_table(c, True, folds, seed) for g, c in groups.items()}
    return lin, log


# ---- the analysis --------------------------------------------------------------------------
@dataclass
class RegressionTables:
    """Held-out R², rows the feature sets (index ``features``), columns all / first / tail."""

    regression_r2: pd.DataFrame  # Table 1: ĉ on α, r, κ and pairwise products
    log_regression_r2: pd.DataFrame  # Table 3: log|ĉ| on log α, log r, log|κ|


class Regression(Analysis[RegressionTables]):
    """Tables 1 and 3: held-out R² of ĉ on its components, linear and in logs."""

    name = "regression"
    aliases = ("regression_r2", "log_regression_r2")
    json_keys = ("regression_r2", "log_regression_r2")
    attributes = ("regression_r2", "log_regression_r2")

    def stats(self, num_layers: int, num_heads: int, options: GeometryOptions) -> dict[str, Stat]:
        return sampled_points(num_layers, options)

    def build(self, ctx: TableContext) -> RegressionTables:
        assert ctx.groups is not None
        lin, log = regression_tables(ctx.groups, ctx.options.folds, ctx.options.seed)
        return RegressionTables(
            pd.DataFrame(lin).rename_axis("features"), pd.DataFrame(log).rename_axis("features")
        )

    def to_json(self, table: RegressionTables) -> dict[str, Any]:
        return {
            "regression_r2": nested(table.regression_r2),
            "log_regression_r2": nested(table.log_regression_r2),
        }

    def from_saved(self, saved: SavedRun) -> RegressionTables | None:
        lin, log = saved.tables.get("regression_r2"), saved.tables.get("log_regression_r2")
        if lin is None or log is None:
            return None
        return RegressionTables(from_nested(lin, "features"), from_nested(log, "features"))

    def markdown(self, table: RegressionTables, result: ResultView) -> list[str]:
        n = ", ".join(f"{g} {c:,}" for g, c in result.points.items())
        return [
            "## Component regression, held-out R² (Table 1)",
            f"Sampled points: {n}.",
            "",
            markdown_table(table.regression_r2),
            "",
            "## Log-component regression, held-out R² (Table 3)",
            "",
            markdown_table(table.log_regression_r2),
            "",
        ]


register_analysis(Regression())
