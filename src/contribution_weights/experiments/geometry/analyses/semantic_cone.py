"""The semantic cone (paper Figure 6a/b): the sink pulls low-norm outputs out of it.

Per head and text, μ̂ is the normalised mean of the non-sink ṽ_j (j ≥ 1), the sink
ṽ_0 = aμ̂ + bû, and the cone is the smallest angle around μ̂ holding 90% of the non-sink
values (zero values left out). Every head output o_i^(h) (i ≥ 1) is tested against the
cone as is and with the sink's value set to 0 (o_i^(h) − α_i0 ṽ_0, the same layer
inputs); counted for the low-norm outputs (the bottom ``low_quantile`` of ‖o_i^(h)‖ per
head and text) and for all. The projections of the run's first text onto (μ̂, û) are
kept for the figure.

Null (the statistic with the sink replaced by a random token): the fraction inside the
cone with a random non-sink token c's value removed instead of the sink's,
o_i^(h) − α_ic ṽ_c, for the same outputs, the same cone and the same low-norm outputs;
:data:`CONE_DRAWS` draws, each one token per text (the same in every layer and head),
seeded by the run's seed and the text's number. It asks whether taking out any token's
value moves outputs into the cone as much as taking out the sink's.
Reported per layer and over all layers (row ``all``), for the low-norm and for all
outputs: the null's mean ± sd and the one-sided p-value of the sink's removal moving
*more* outputs inside than a random token's, (1 + #{draws ≥ statistic}) / (1 + draws).
With c = 0 a draw is the statistic itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from ...options import GeometryOptions
from ...stats import (
    CONE_STREAM,
    BlockView,
    Stat,
    permutation_summary,
    random_tokens,
)
from ..analysis import (
    Analysis,
    markdown_table,
    null_from_json,
    null_markdown,
    null_to_json,
    records,
    register_analysis,
)
from ..analysis_types import ResultView, SavedRun, TableContext

FRACTIONS = (
    "low_inside_with_sink",
    "low_inside_without_sink",
    "all_inside_with_sink",
    "all_inside_without_sink",
)
#: draws of the cone's null (fewer than other nulls': each tests every output again)
CONE_DRAWS = 100
#: what the null removes in place of the sink's value, and the direction of its p-value
NULL_TOKEN = "a random non-sink token's value per text (seeded) removed instead of the sink's"
ALTERNATIVE = "greater"
NULL_COLUMNS = (
    "low_inside_without_sink",
    "low_null_mean",
    "low_null_sd",
    "low_p_value",
    "all_inside_without_sink",
    "all_null_mean",
    "all_null_sd",
    "all_p_value",
)


@dataclass
class ConeGeometry:
    """Per head ``(H, …)``: μ̂, û, the sink's (a, b), cos of the 90% cone angle."""

    mu: Tensor  # (H, d)
    u: Tensor  # (H, d)
    sink: Tensor  # (H, 2): a, b
    cos_cone: Tensor  # (H,)


def cone_geometry(projected: Tensor, coverage: float = 0.9) -> ConeGeometry:
    """Semantic direction, its orthogonal complement through the sink, and the cone."""
    sink, tail = projected[:, 0], projected[:, 1:]
    mean = tail.mean(1)
    mu = mean / mean.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    a = (sink * mu).sum(-1)
    resid = sink - a[:, None] * mu
    b = resid.norm(dim=-1)
    # where the sink lies on the μ̂ axis, û is taken from the tail's spread instead
    tail_resid = tail - (tail @ mu[:, :, None]) * mu[:, None]
    fallback = tail_resid[torch.arange(tail.shape[0]), tail_resid.norm(dim=-1).argmax(-1)]
    scale_ok = b > 1e-6 * sink.norm(dim=-1).clamp_min(1e-30)
    u = torch.where(scale_ok[:, None], resid, fallback)
    u = u / u.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    tail_norm = tail.norm(dim=-1)
    cos = (tail @ mu[:, :, None]).squeeze(-1) / tail_norm.clamp_min(1e-30)
    cos = torch.where(tail_norm > 0, cos, torch.full_like(cos, float("nan")))  # no direction
    cos_cone = torch.nanquantile(cos.double(), 1 - coverage, dim=-1).to(cos.dtype)
    return ConeGeometry(mu, u, torch.stack([a, b], -1), cos_cone)


class SemanticCone(Stat):
    """Fractions of (low-norm) head outputs inside the 90% cone, with and without the sink."""

    COUNTS = (
        "low",
        "low_inside_with_sink",
        "low_inside_without_sink",
        "all",
        "all_inside_with_sink",
        "all_inside_without_sink",
    )

    def __init__(
        self,
        num_layers: int,
        num_heads: int,
        low_quantile: float = 0.25,
        coverage: float = 0.9,
        seed: int = 0,
        draws: int = CONE_DRAWS,
    ) -> None:
        super().__init__(num_layers)
        self.low_quantile = low_quantile
        self.coverage = coverage
        self.counts = np.zeros((num_layers, len(self.COUNTS)))
        # the null: per layer, low-norm and all outputs inside without each draw's token
        self.null_counts = np.zeros((num_layers, 2, draws))
        self.null_sequences = 0  # sequences the null saw (all of them, or it is not shown)
        self.snapshot: dict[str, Tensor] = {}  # projections of the first sequence
        self._seed = seed
        self._positions = torch.zeros(0, dtype=torch.long)
        self._buf: dict[int, Tensor] = {}
        self._null_buf: dict[int, Tensor] = {}  # per layer (H, T, draws): inside without c
        self._t = 0
        self._unit = 0

    def begin(self, num_tokens: int, unit: int = 0) -> None:
        self._buf = {}
        self._null_buf = {}
        self._t = num_tokens
        self._unit = unit
        draws = self.null_counts.shape[2]
        positions = random_tokens(num_tokens, draws, self._seed, unit, CONE_STREAM)
        self._positions = torch.from_numpy(positions)

    def merge(self, state: dict[str, Any]) -> None:
        super().merge(state)
        self.counts = self.counts + state["counts"]
        if "null_counts" in state:  # else the null misses those sequences (and is not shown)
            self.null_counts = self.null_counts + state["null_counts"]
            self.null_sequences += int(state["null_sequences"])
        if state["snapshot"] and not self.snapshot:  # the first sequence's, wherever it ran
            self.snapshot = dict(state["snapshot"])

    def observe(self, view: BlockView) -> None:
        if self._t < 3:
            return
        if view.first_block:
            view.scratch["cone"] = cone_geometry(view.projected_values, self.coverage)
            h = view.alpha.shape[0]
            self._buf[view.layer] = torch.zeros(3, h, self._t)
        geo: ConeGeometry = view.scratch["cone"]
        out = view.lt.head_outputs[0]  # (H, I, d)
        v0 = view.projected_values[:, 0]
        no_sink = out - view.alpha[:, :, 0, None] * v0[:, None, :]
        buf = self._buf[view.layer]
        for k, o in ((1, out), (2, no_sink)):
            norm = o.norm(dim=-1)
            cos = (o @ geo.mu[:, :, None]).squeeze(-1) / norm.clamp_min(1e-30)
            buf[k, :, view.rows] = ((cos >= geo.cos_cone[:, None]) & (norm > 0)).float()
            if k == 1:
                buf[0, :, view.rows] = norm
        if len(self._positions):
            self._observe_null(view, geo, out)
        if self._unit == 0:  # the snapshot is of the run's first sequence
            self._snap(view, geo, out, no_sink)
        if view.rows.stop >= self._t:  # the layer's last block: its counts are final
            self._finish(view.layer)

    def _observe_null(self, view: BlockView, geo: ConeGeometry, out: Tensor) -> None:
        """Per draw, which outputs of the block are inside the cone with the drawn token's
        value removed, o − α_ic ṽ_c, from ⟨o, ṽ_c⟩ (one matmul for all draws:
        ‖o − α ṽ_c‖² = ‖o‖² − 2α⟨o, ṽ_c⟩ + α²‖ṽ_c‖², in the statistics' dtype)."""
        positions = self._positions.to(out.device)
        v = view.projected_values[:, positions]  # (H, K, d)
        a = view.alpha[:, :, positions]  # (H, I, K)
        o_mu = (out @ geo.mu[:, :, None]).squeeze(-1)  # (H, I)
        v_mu = (v @ geo.mu[:, :, None]).squeeze(-1)  # (H, K)
        along = torch.addcmul(o_mu[:, :, None], a, v_mu[:, None, :], value=-1)  # (H, I, K)
        norm = a * v.square().sum(-1)[:, None, :]  # ‖o‖² + α(α‖ṽ_c‖² − 2⟨o, ṽ_c⟩), in place
        norm.sub_(out @ v.transpose(1, 2), alpha=2).mul_(a).add_(out.square().sum(-1)[:, :, None])
        norm.clamp_(min=0).sqrt_()
        inside = (along >= norm * geo.cos_cone[:, None, None]) & (norm > 0)  # (H, I, K)
        if view.layer not in self._null_buf:
            h, k = inside.shape[0], inside.shape[2]
            self._null_buf[view.layer] = torch.zeros(h, self._t, k, dtype=torch.bool)
        self._null_buf[view.layer][:, view.rows] = inside.cpu()

    def _snap(self, view: BlockView, geo: ConeGeometry, out: Tensor, no_sink: Tensor) -> None:
        basis = torch.stack([geo.mu, geo.u], dim=-1)  # (H, d, 2)
        h, t = view.alpha.shape[0], self._t
        snap = self.snapshot
        if view.layer == 0 and view.first_block:
            snap.clear()
        if f"with_{view.layer}" not in snap:
            snap[f"with_{view.layer}"] = torch.zeros(h, t, 2)
            snap[f"without_{view.layer}"] = torch.zeros(h, t, 2)
            snap[f"sink_{view.layer}"] = geo.sink.float().cpu()
            snap[f"cos_cone_{view.layer}"] = geo.cos_cone.float().cpu()
            snap[f"sink_rate_{view.layer}"] = torch.zeros(h)
        snap[f"with_{view.layer}"][:, view.rows] = (out @ basis).float().cpu()
        snap[f"without_{view.layer}"][:, view.rows] = (no_sink @ basis).float().cpu()
        snap[f"sink_rate_{view.layer}"] += view.alpha[:, :, 0].sum(-1).float().cpu() / t

    def _finish(self, layer: int) -> None:
        """Fold one layer's buffers of the sequence into the counts, and free them."""
        buf = self._buf.pop(layer, None)
        if buf is None:
            return
        norm, with_sink, without = buf[0, :, 1:], buf[1, :, 1:], buf[2, :, 1:]
        thr = torch.quantile(norm.double(), self.low_quantile, dim=-1, keepdim=True)
        low = (norm.double() <= thr).float()
        self.counts[layer] += [
            float(low.sum()),
            float((low * with_sink).sum()),
            float((low * without).sum()),
            float(norm.numel()),
            float(with_sink.sum()),
            float(without.sum()),
        ]
        null = self._null_buf.pop(layer, None)
        if null is not None:
            inside = null[:, 1:]  # (H, T-1, K)
            low_inside = inside & (low.cpu() > 0)[:, :, None]
            self.null_counts[layer, 0] += low_inside.sum((0, 1)).double().numpy()
            self.null_counts[layer, 1] += inside.sum((0, 1)).double().numpy()

    def end(self) -> None:
        for layer in list(self._buf):
            self._finish(layer)
        self._buf, self._null_buf = {}, {}
        self.null_sequences += 1
        super().end()

    def null_fractions(self) -> np.ndarray | None:
        """``(L + 1, 2, draws)``: per layer and over all layers (the last row), the
        fractions of low-norm and of all outputs inside the cone without each draw's
        token; None unless the null saw every sequence."""
        if self.null_sequences != self.sequences:
            return None
        c = np.concatenate([self.counts, self.counts.sum(0, keepdims=True)])
        null = np.concatenate([self.null_counts, self.null_counts.sum(0, keepdims=True)])
        with np.errstate(invalid="ignore", divide="ignore"):
            return null / np.stack([c[:, 0], c[:, 3]], 1)[:, :, None]

    def fractions(self) -> np.ndarray:
        """``(L, 4)``: low-norm inside with / without sink, all inside with / without."""
        c = self.counts
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.stack(
                [c[:, 1] / c[:, 0], c[:, 2] / c[:, 0], c[:, 4] / c[:, 3], c[:, 5] / c[:, 3]], 1
            )


# ---- the analysis --------------------------------------------------------------------------
@dataclass
class SemanticConeTables:
    """Per layer and overall (row ``all``) the fractions inside the cone, and the first
    text's projections (the figure's data; empty for a run folder read without state)."""

    semantic_cone: pd.DataFrame
    cone_snapshot: dict[str, Any] = field(default_factory=dict)
    # the null, per layer and "all" (None: not computed, e.g. a folder written before it)
    null: pd.DataFrame | None = None


def null_table(table: pd.DataFrame, fractions: np.ndarray) -> pd.DataFrame:
    """Per row of ``table`` (layers, then ``all``): the fractions inside without the sink
    beside the null's mean ± sd over draws and the one-sided p-value (:data:`ALTERNATIVE`)."""
    rows = []
    for (_, row), null in zip(table.iterrows(), fractions, strict=True):
        out: dict[str, float] = {}
        for k, kind in enumerate(("low", "all")):
            stat = float(row[f"{kind}_inside_without_sink"])
            summary = permutation_summary(stat, null[k], ALTERNATIVE)
            out[f"{kind}_inside_without_sink"] = stat
            out.update({f"{kind}_{key}": value for key, value in summary.items()})
        rows.append(out)
    return pd.DataFrame(rows, table.index, list(NULL_COLUMNS))


class SemanticConeAnalysis(Analysis[SemanticConeTables]):
    """Figure 6a/b: low-norm head outputs inside the 90% cone, with and without the sink."""

    name = "semantic_cone"
    attributes = ("semantic_cone", "cone_snapshot", "semantic_cone_null")

    def stats(self, num_layers: int, num_heads: int, options: GeometryOptions) -> dict[str, Stat]:
        return {
            "semantic_cone": SemanticCone(
                num_layers, num_heads, options.low_quantile, options.cone_coverage, options.seed
            )
        }

    def attribute(self, table: SemanticConeTables, name: str) -> Any:
        return table.null if name == "semantic_cone_null" else getattr(table, name)

    def build(self, ctx: TableContext) -> SemanticConeTables:
        cone = ctx.stats["semantic_cone"]
        assert isinstance(cone, SemanticCone)
        layers = pd.Index(range(ctx.num_layers), name="layer")
        table = pd.DataFrame(cone.fractions(), layers, list(FRACTIONS))
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
        fractions = cone.null_fractions()
        null = None if fractions is None else null_table(table, fractions)
        return SemanticConeTables(table, dict(cone.snapshot), null)

    def to_json(self, table: SemanticConeTables) -> dict[str, Any]:
        c = table.semantic_cone
        out: dict[str, Any] = {
            "overall": records(c[c.index == "all"])[0] if "all" in c.index else None,
            "by_layer": records(c[c.index != "all"].reset_index()),
        }
        if table.null is not None:
            out["null"] = null_to_json(table.null, "all", NULL_TOKEN, ALTERNATIVE)
        return {"semantic_cone": out}

    def from_saved(self, saved: SavedRun) -> SemanticConeTables | None:
        data = saved.tables.get("semantic_cone")
        if data is None:
            return None
        rows = [{k: v for k, v in r.items() if k != "layer"} for r in data["by_layer"]]
        index = [r["layer"] for r in data["by_layer"]]
        if data["overall"] is not None:
            rows.append(data["overall"])
            index.append("all")
        table = pd.DataFrame(rows, pd.Index(index, dtype=object, name="layer"))
        null = null_from_json(data["null"], "all", NULL_COLUMNS) if data.get("null") else None
        return SemanticConeTables(table.astype(dict.fromkeys(FRACTIONS, float)), null=null)

    def markdown(self, table: SemanticConeTables, result: ResultView) -> list[str]:
        lines = ["## Semantic cone (Figure 6a/b)", "", markdown_table(table.semantic_cone), ""]
        return [*lines, *null_markdown(table.null, "all", _about_null)]


def _about_null(overall: pd.Series) -> str:
    return (
        f"Null: the fraction inside the cone with {NULL_TOKEN}; low-norm outputs, all "
        f"layers: {overall['low_null_mean']:.3f} ± {overall['low_null_sd']:.3f} against "
        f"{overall['low_inside_without_sink']:.3f} without the sink (one-sided "
        f"p = {overall['low_p_value']:.3f})."
    )


register_analysis(SemanticConeAnalysis())
