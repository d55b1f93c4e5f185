"""Joint distributions (paper Figure 7): the sampled (α, ‖ṽ‖, κ) pairs, a figure only.

The pairs are the shared sample of the regressions (:class:`~...stats.ComponentPoints`,
group ``all``); nothing goes to ``tables.json`` or ``tables.md``.
"""

from __future__ import annotations

import pandas as pd

from ...options import GeometryOptions
from ...stats import Stat
from ..analysis import Analysis, register_analysis, sampled_points
from ..analysis_types import TableContext


class JointDistributions(Analysis[pd.DataFrame]):
    """Figure 7: the sampled pairs, columns alpha, r, kappa, vnorm, layer, first."""

    name = "joint_distributions"
    aliases = ("joint",)
    attributes = ("joint",)

    def json_entries(self) -> tuple[str, ...]:
        return ()  # a figure only: nothing in tables.json

    def stats(self, num_layers: int, num_heads: int, options: GeometryOptions) -> dict[str, Stat]:
        return sampled_points(num_layers, options)

    def build(self, ctx: TableContext) -> pd.DataFrame:
        assert ctx.groups is not None
        return pd.DataFrame({k: v for k, v in ctx.groups["all"].items() if k != "c"})

    def attribute(self, table: pd.DataFrame, name: str) -> pd.DataFrame:
        return table  # result.joint


register_analysis(JointDistributions())
