"""Sink / tail alignment (paper Figure 5): how the sink's value lines up with the others.

Per layer and head, the mean of cos(ṽ_0, ṽ_j) over j ≥ 1 and of cos(ṽ_i, ṽ_j) over
i ≠ j ≥ 1 (computed as (‖Σ u_j‖² − Σ‖u_j‖²)/(n(n−1)) with unit vectors u; a zero vector
counts as cosine 0), averaged over heads and texts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pandas as pd
import torch
from torch import Tensor

from ....measures.layer import safe_div
from ...stats import BlockView, LayerMeans
from ..analysis import LayerMeansAnalysis, markdown_table, num, records, register_analysis

if TYPE_CHECKING:
    from ..result import GeometryResult

COLUMNS = ("sink_tail", "tail_tail")


def alignment(projected: Tensor) -> tuple[Tensor, Tensor]:
    """Per head ``(H,)``: mean cos(ṽ_0, ṽ_j) over j ≥ 1, and mean cos(ṽ_i, ṽ_j), i ≠ j ≥ 1.

    Zero vectors count as cosine 0. Needs at least 2 (sink/tail) and 3 (tail/tail) tokens;
    otherwise the entry is NaN.
    """
    norm = projected.norm(dim=-1, keepdim=True)
    unit = safe_div(projected, norm)
    h, t, _ = unit.shape
    nan = torch.full((h,), float("nan"), dtype=unit.dtype)
    if t < 2:
        return nan, nan
    tail = unit[:, 1:]
    sink_tail = (tail @ unit[:, 0, :, None]).squeeze(-1).mean(-1)
    n = t - 1
    if n < 2:
        return sink_tail, nan
    total = tail.sum(1)
    pair_sum = total.square().sum(-1) - tail.square().sum((-1, -2))
    return sink_tail, pair_sum / (n * (n - 1))


class SinkAlignment(LayerMeans):
    """Figure 5: per layer, mean over heads of the sink/tail and tail/tail cosines."""

    columns = COLUMNS

    def observe(self, view: BlockView) -> None:
        if not view.first_block:
            return
        sink_tail, tail_tail = alignment(view.projected_values)
        for k, value in enumerate((sink_tail, tail_tail)):
            if not bool(torch.isnan(value).any()):
                self._seq[view.layer, k] += float(value.mean())
                self._seq_n[view.layer, k] += 1


# ---- the analysis: its table is the per-layer DataFrame (sink_tail, tail_tail) ---------------
class SinkAlignmentAnalysis(LayerMeansAnalysis[pd.DataFrame]):
    """Figure 5: per layer, mean cos(ṽ_0, ṽ_j) and cos(ṽ_i, ṽ_j)."""

    name = "sink_alignment"
    stat = SinkAlignment  # its columns of per_layer.csv are unprefixed

    def to_json(self, table: pd.DataFrame) -> dict[str, Any]:
        return {
            "sink_alignment": {
                "mean": {c: num(table[c].mean()) for c in COLUMNS},
                "by_layer": records(table.reset_index()),
            }
        }

    def markdown(self, table: pd.DataFrame, result: GeometryResult) -> list[str]:
        mean = table.mean()
        return [
            "## Sink / tail alignment (Figure 5)",
            f"Mean over layers: cos(ṽ_0, ṽ_j) = {mean['sink_tail']:.3f}, "
            f"cos(ṽ_i, ṽ_j) = {mean['tail_tail']:.3f}.",
            "",
            markdown_table(table.join(result.sink_rate)),
            "",
        ]


register_analysis(SinkAlignmentAnalysis())
