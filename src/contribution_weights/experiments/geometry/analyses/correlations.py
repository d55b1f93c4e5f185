"""Correlations of the log components (paper Table 2): exact, over every valid pair.

Running means and co-moments of (log α, log r, log|κ|), merged batch by batch (Chan et
al., :class:`~...sampling.Moments`), for all j, j = 0 and j ≥ 1; ``tables.json`` has all
three groups, ``tables.md`` all j.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch

from ...options import GeometryOptions
from ...sampling import Moments
from ...stats import GROUPS, BlockView, Stat
from ..analysis import Analysis, from_nested, markdown_table, nested, register_analysis
from ..analysis_types import ResultView, SavedRun, TableContext

LOG_NAMES = ("log_alpha", "log_r", "log_kappa")


class LogCorrelations(Stat):
    """Table 2: Pearson correlations of log α, log r, log|κ| over every valid pair (exact)."""

    def __init__(self, num_layers: int) -> None:
        super().__init__(num_layers)
        self.moments = {g: Moments(LOG_NAMES) for g in GROUPS}

    def observe(self, view: BlockView) -> None:
        ok = view.points & (view.alpha > 0) & (view.r > 0) & (view.kappa != 0)
        idx = ok.reshape(-1).nonzero().squeeze(1)
        if idx.numel() == 0:
            return
        comps = (view.alpha, view.r, view.kappa.abs())
        logs = torch.stack([c.reshape(-1)[idx].double().log() for c in comps], dim=-1)
        first = (idx % view.alpha.shape[-1]) == 0
        self.moments["all"].add(logs)
        self.moments["first"].add(logs[first])
        self.moments["tail"].add(logs[~first])

    def merge(self, state: dict[str, Any]) -> None:
        super().merge(state)
        for g, m in self.moments.items():
            m.merge(state[g])

    def state_dict(self) -> dict[str, Any]:
        return {"sequences": self.sequences, **{g: m.state_dict() for g, m in self.moments.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sequences = state["sequences"]
        for g, m in self.moments.items():
            m.load_state_dict(state[g])


# ---- the analysis --------------------------------------------------------------------------
@dataclass
class CorrelationTables:
    """Per token group (all, first, tail): the 3×3 correlations and the pairs counted (n)."""

    correlations_by_group: dict[str, pd.DataFrame]

    @property
    def correlations(self) -> pd.DataFrame:
        """The 3×3 correlations of group ``all``."""
        return self.correlations_by_group["all"].drop(columns="n")


class Correlations(Analysis[CorrelationTables]):
    """Table 2: Pearson correlations of log α, log r, log|κ| (exact, every valid pair)."""

    name = "correlations"
    attributes = ("correlations", "correlations_by_group")

    def stats(self, num_layers: int, num_heads: int, options: GeometryOptions) -> dict[str, Stat]:
        return {"correlations": LogCorrelations(num_layers)}

    def build(self, ctx: TableContext) -> CorrelationTables:
        corr = ctx.stats["correlations"]
        assert isinstance(corr, LogCorrelations)
        return CorrelationTables(
            {
                g: pd.DataFrame(m.correlation(), LOG_NAMES, LOG_NAMES).assign(n=m.n)
                for g, m in corr.moments.items()
            }
        )

    def to_json(self, table: CorrelationTables) -> dict[str, Any]:
        return {"correlations": {g: nested(t) for g, t in table.correlations_by_group.items()}}

    def from_saved(self, saved: SavedRun) -> CorrelationTables | None:
        groups = saved.tables.get("correlations")
        if groups is None:
            return None
        return CorrelationTables({g: from_nested(t) for g, t in groups.items()})

    def markdown(self, table: CorrelationTables, result: ResultView) -> list[str]:
        return [
            "## Correlations of log components, all tokens (Table 2)",
            "",
            markdown_table(table.correlations),
            "",
        ]


register_analysis(Correlations())
