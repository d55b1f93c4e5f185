"""Output norm against sink attention (paper §6.2): the sink as an active suppressor.

Per head, the fit of ‖o_i^(h)‖² on the sink attention α = α_i0:
``‖o‖² ≈ α²‖ṽ_0‖² + 2α(1−α)γ' + (1−α)²κ'²``. With ``‖ṽ_0‖²`` measured (per sequence), the
fit is linear in (γ', κ'²), so its normal equations accumulate exactly across sequences.
The curve is ``qα² + 2(γ'−κ'²)α + κ'²`` with ``q = A − 2γ' + κ'²`` (A the mean ‖ṽ_0‖²):
convex when q > 0, minimal at ``α_min = (κ'² − γ')/q``, and α_min < 1 exactly when γ' < A
(the sink is less aligned with the tail than with itself). ``convex_min_below_1`` marks the
paper's shape: convex with an interior minimum, 0 < α_min < 1 (α_min ≤ 0 would make ‖o‖
grow with α over all of [0, 1]). ``norm_fit.csv`` has one row per head.

Fit quality: the summary gives the median R² over heads and the share of heads with
R² > 0.5. Null: the same fit and the same test over the same heads with a control token
in place of the sink: per text a random non-sink token c (:func:`~...stats.control_token`,
seeded by the run's seed and the text's number), α = α_ic over the queries i ≥ c that can
see it and ‖ṽ_c‖² in place of ‖ṽ_0‖². Its convex share and its share with
0 < α_min < 1 are reported beside the sink's: a shape that any token's attention gives
says nothing about the sink. With c = 0 the null is the fit itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch

from ...options import GeometryOptions
from ...sampling import Reservoir
from ...stats import BlockView, Stat, control_token
from ..analysis import Analysis, markdown_table, num, records, register_analysis
from ..analysis_types import ResultView, SavedRun, TableContext

#: what the norm-fit null puts in place of the sink
NULL_TOKEN = "a random non-sink token per text (seeded) in place of token 0"
#: the share of heads fitting well: R² above this
GOOD_R2 = 0.5


class NormFit(Stat):
    """Per (layer, head) least squares of ‖o‖² − α²‖ṽ_0‖² on [2α(1−α), (1−α)²].

    ``control_seed`` set: the null, with α and ṽ of a control token c per sequence
    (:meth:`token_for`) in place of token 0's, over the queries i ≥ c (no sampled points).
    """

    def __init__(
        self,
        num_layers: int,
        num_heads: int,
        points_per_head: int = 256,
        control_seed: int | None = None,
    ) -> None:
        super().__init__(num_layers)
        self._control_seed = control_seed
        self._token: int | None = 0
        shape = (num_layers, num_heads)
        self.xtx = np.zeros((*shape, 2, 2))
        self.xty = np.zeros((*shape, 2))
        self.yty = np.zeros(shape)  # Σ y'² (y' = y − α² A_seq)
        self.ysum = np.zeros(shape)  # Σ y  (for the R² of y itself)
        self.ysq = np.zeros(shape)  # Σ y²
        self.n = np.zeros(shape)
        self.v0_sum = np.zeros(shape)
        self.v0_count = np.zeros(shape)
        self.points = [
            [
                Reservoir(("alpha", "norm2"), points_per_head, seed=97 * i + h)
                for h in range(num_heads)
            ]
            for i in range(num_layers if control_seed is None else 0)
        ]

    def token_for(self, num_tokens: int, unit: int) -> int | None:
        """The token whose attention is fitted in sequence ``unit``: 0 (the sink), or for
        the null its control token (None: the sequence is too short to have one)."""
        if self._control_seed is None:
            return 0
        return control_token(num_tokens, self._control_seed, unit)

    def observe(self, view: BlockView) -> None:
        c = self._token
        if c is None:
            return
        layer = view.layer
        v0 = view.value_norm[:, c].double().square()  # (H,)
        if view.first_block:
            self.v0_sum[layer] += v0.numpy()
            self.v0_count[layer] += 1
        a = view.alpha[:, :, c].double()  # (H, I)
        y = view.lt.head_output_norm2[0].double()  # (H, I)
        if c > 0:  # the queries that can see the control token
            sees = view.query_index >= c
            if not bool(sees.any()):
                return
            a, y = a[:, sees], y[:, sees]
        y_res = y - a.square() * v0[:, None]
        x = torch.stack([2 * a * (1 - a), (1 - a).square()], dim=-1)  # (H, I, 2)
        self.xtx[layer] += torch.einsum("hik,hil->hkl", x, x).numpy()
        self.xty[layer] += torch.einsum("hik,hi->hk", x, y_res).numpy()
        self.yty[layer] += y_res.square().sum(-1).numpy()
        self.ysum[layer] += y.sum(-1).numpy()
        self.ysq[layer] += y.square().sum(-1).numpy()
        self.n[layer] += a.shape[1]
        for h, res in enumerate(self.points[layer] if self.points else ()):
            res.add([a[h].float(), y[h].float()])

    def begin(self, num_tokens: int, unit: int = 0) -> None:
        self._token = self.token_for(num_tokens, unit)
        for i, row in enumerate(self.points):
            for h, res in enumerate(row):
                res.reseed(97 * i + h, unit)

    def merge(self, state: dict[str, Any]) -> None:
        super().merge(state)
        for key in ("xtx", "xty", "yty", "ysum", "ysq", "n", "v0_sum", "v0_count"):
            setattr(self, key, getattr(self, key) + state[key])
        for row, row_state in zip(self.points, state["points"], strict=True):
            for res, res_state in zip(row, row_state, strict=True):
                res.merge(res_state)

    def fit(self) -> list[dict[str, Any]]:
        """One row per head: γ', κ'², A, the curve's q, α_min, convexity, R² of ‖o‖²."""
        rows = []
        for layer in range(self.xtx.shape[0]):
            for head in range(self.xtx.shape[1]):
                n = self.n[layer, head]
                if n < 3:
                    continue
                coef = np.linalg.lstsq(self.xtx[layer, head], self.xty[layer, head], rcond=None)[0]
                gamma, kappa2 = (float(c) for c in coef)
                a_mean = self.v0_sum[layer, head] / max(self.v0_count[layer, head], 1)
                q = a_mean - 2 * gamma + kappa2
                alpha_min = (kappa2 - gamma) / q if q != 0 else float("nan")
                sse = self.yty[layer, head] - 2 * coef @ self.xty[layer, head]
                sse += coef @ self.xtx[layer, head] @ coef
                sst = self.ysq[layer, head] - self.ysum[layer, head] ** 2 / n
                rows.append(
                    {
                        "layer": layer,
                        "head": head,
                        "gamma_prime": gamma,
                        "kappa2": kappa2,
                        "v0_norm2": float(a_mean),
                        "q": float(q),
                        "alpha_min": float(alpha_min),
                        "convex": bool(q > 0),
                        "convex_min_below_1": bool(q > 0 and 0 < alpha_min < 1),
                        "r2": float(1 - sse / sst) if sst > 0 else float("nan"),
                        "n": int(n),
                    }
                )
        return rows

    def state_dict(self) -> dict[str, Any]:
        state = {k: v for k, v in vars(self).items() if k != "points" and not k.startswith("_")}
        state["points"] = [[r.state_dict() for r in row] for row in self.points]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            if key != "points":
                setattr(self, key, value)
        for row, row_state in zip(self.points, state["points"], strict=True):
            for res, res_state in zip(row, row_state, strict=True):
                res.load_state_dict(res_state)


def norm_fit_summary(t: pd.DataFrame, extended: bool = False) -> dict[str, Any]:
    """Heads fitted, the fractions with the paper's shape and with γ' < 0, medians;
    ``extended``: also the convex share and the share of heads with R² > 0.5."""
    if t.empty:
        return {"heads": 0}
    summary = {
        "heads": len(t),
        "fraction_convex_min_below_1": num(t["convex_min_below_1"].mean()),
        "fraction_gamma_prime_negative": num((t["gamma_prime"] < 0).mean()),
        "median_alpha_min": num(t["alpha_min"].median()),
        "median_r2": num(t["r2"].median()),
    }
    if extended:
        summary["fraction_convex"] = num(t["convex"].astype(float).mean())
        summary[f"fraction_r2_above_{GOOD_R2}"] = num((t["r2"] > GOOD_R2).mean())
    return summary


# ---- the analysis --------------------------------------------------------------------------
@dataclass
class NormFitTables:
    """One row per head (the fit), and per head the sampled (α_i0, ‖o‖²) points."""

    norm_fit: pd.DataFrame
    norm_points: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    # the null's fit, one row per head (None: not computed, e.g. a folder written before it)
    null: pd.DataFrame | None = None
    # the summary has the fit-quality shares (False: a folder written before they were)
    extended: bool = True


class NormFitAnalysis(Analysis[NormFitTables]):
    """§6.2: per head, the fit of ‖o‖² on the sink attention."""

    name = "norm_fit"
    attributes = ("norm_fit", "norm_points", "norm_fit_null")

    def stats(self, num_layers: int, num_heads: int, options: GeometryOptions) -> dict[str, Stat]:
        return {
            "norm_fit": NormFit(num_layers, num_heads),
            "norm_fit_null": NormFit(num_layers, num_heads, control_seed=options.seed),
        }

    def build(self, ctx: TableContext) -> NormFitTables:
        fit = ctx.stats["norm_fit"]
        assert isinstance(fit, NormFit)
        points = {
            (i, h): np.column_stack(list(r.to_numpy().values()))  # in key order
            for i, row in enumerate(fit.points)
            for h, r in enumerate(row)
            if len(r)
        }
        null = ctx.stats.get("norm_fit_null")
        # the null covers every sequence, or it is not shown (a run resumed from a state
        # written before it had one)
        complete = isinstance(null, NormFit) and null.sequences == fit.sequences
        null_table = pd.DataFrame(null.fit()) if complete and isinstance(null, NormFit) else None
        return NormFitTables(pd.DataFrame(fit.fit()), points, null_table)

    def attribute(self, table: NormFitTables, name: str) -> Any:
        return table.null if name == "norm_fit_null" else getattr(table, name)

    def to_json(self, table: NormFitTables) -> dict[str, Any]:
        out: dict[str, Any] = {
            "summary": norm_fit_summary(table.norm_fit, table.extended),
            "heads": records(table.norm_fit),
        }
        if table.null is not None:
            out["null"] = {
                "token": NULL_TOKEN,
                "summary": norm_fit_summary(table.null, extended=True),
                "heads": records(table.null),
            }
        return {"norm_fit": out}

    def from_saved(self, saved: SavedRun) -> NormFitTables | None:
        data = saved.tables.get("norm_fit")
        if data is None:
            return None
        extended = f"fraction_r2_above_{GOOD_R2}" in data["summary"]
        null = _heads(data["null"]["heads"]) if data.get("null") else None
        return NormFitTables(_heads(data["heads"]), null=null, extended=extended)  # no points

    def files(self, table: NormFitTables) -> dict[str, bytes]:
        return {"norm_fit.csv": table.norm_fit.to_csv(index=False).encode()}

    def markdown(self, table: NormFitTables, result: ResultView) -> list[str]:
        title = ["## Output norm vs sink attention (§6.2)", ""]
        if table.null is None:
            summary = pd.DataFrame([norm_fit_summary(table.norm_fit, table.extended)])
            return [*title, markdown_table(summary), ""]
        summary = pd.DataFrame(
            [norm_fit_summary(table.norm_fit, True), norm_fit_summary(table.null, True)],
            pd.Index(["token 0 (sink)", "random token (null)"], name="fitted token"),
        )
        return [
            *title,
            markdown_table(summary),
            "",
            f"Null: the same fit with {NULL_TOKEN}, over the queries that can see it.",
            "",
        ]


def _heads(rows: list[dict[str, Any]]) -> pd.DataFrame:
    heads = pd.DataFrame(rows)
    floats = [c for c in heads.columns if heads[c].dtype == object]  # None: NaN
    return heads.astype(dict.fromkeys(floats, float))


register_analysis(NormFitAnalysis())
