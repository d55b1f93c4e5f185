"""The semantic cone (paper Figure 6a/b): the sink pulls low-norm outputs out of it.

Per head and text, μ̂ is the normalised mean of the non-sink ṽ_j (j ≥ 1), the sink
ṽ_0 = aμ̂ + bû, and the cone is the smallest angle around μ̂ holding 90% of the non-sink
values (zero values left out). Every head output o_i^(h) (i ≥ 1) is tested against the
cone as is and with the sink's value set to 0 (o_i^(h) − α_i0 ṽ_0, the same layer
inputs); counted for the low-norm outputs (the bottom ``low_quantile`` of ‖o_i^(h)‖ per
head and text) and for all. The projections of the run's first text onto (μ̂, û) are
kept for the figure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from ...options import GeometryOptions
from ...stats import BlockView, Stat
from ..analysis import (
    Analysis,
    SavedRun,
    TableContext,
    markdown_table,
    records,
    register_analysis,
)

if TYPE_CHECKING:
    from ..result import GeometryResult

FRACTIONS = (
    "low_inside_with_sink",
    "low_inside_without_sink",
    "all_inside_with_sink",
    "all_inside_without_sink",
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
        self, num_layers: int, num_heads: int, low_quantile: float = 0.25, coverage: float = 0.9
    ) -> None:
        super().__init__(num_layers)
        self.low_quantile = low_quantile
        self.coverage = coverage
        self.counts = np.zeros((num_layers, len(self.COUNTS)))
        self.snapshot: dict[str, Tensor] = {}  # projections of the first sequence
        self._buf: dict[int, Tensor] = {}
        self._t = 0
        self._unit = 0

    def begin(self, num_tokens: int, unit: int = 0) -> None:
        self._buf = {}
        self._t = num_tokens
        self._unit = unit

    def merge(self, state: dict[str, Any]) -> None:
        super().merge(state)
        self.counts = self.counts + state["counts"]
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
        if self._unit == 0:  # the snapshot is of the run's first sequence
            self._snap(view, geo, out, no_sink)

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

    def end(self) -> None:
        for layer, buf in self._buf.items():
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
        self._buf = {}
        super().end()

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


class SemanticConeAnalysis(Analysis[SemanticConeTables]):
    """Figure 6a/b: low-norm head outputs inside the 90% cone, with and without the sink."""

    name = "semantic_cone"
    attributes = ("semantic_cone", "cone_snapshot")

    def stats(self, num_layers: int, num_heads: int, options: GeometryOptions) -> dict[str, Stat]:
        return {
            "semantic_cone": SemanticCone(
                num_layers, num_heads, options.low_quantile, options.cone_coverage
            )
        }

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
        return SemanticConeTables(table, dict(cone.snapshot))

    def to_json(self, table: SemanticConeTables) -> dict[str, Any]:
        c = table.semantic_cone
        return {
            "semantic_cone": {
                "overall": records(c[c.index == "all"])[0] if "all" in c.index else None,
                "by_layer": records(c[c.index != "all"].reset_index()),
            }
        }

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
        return SemanticConeTables(table.astype(dict.fromkeys(FRACTIONS, float)))

    def markdown(self, table: SemanticConeTables, result: GeometryResult) -> list[str]:
        return ["## Semantic cone (Figure 6a/b)", "", markdown_table(table.semantic_cone), ""]


register_analysis(SemanticConeAnalysis())
