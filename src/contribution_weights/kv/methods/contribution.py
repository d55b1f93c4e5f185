"""Ours: ``|ĉ_ij^(h)|`` summed over the last ``window`` queries and the query heads of each
KV group; the window's own keys are always kept (as in SnapKV)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .base import WindowSum
from .stats import LayerStats


@dataclass(frozen=True)
class Contribution(WindowSum):
    """Ours: |ĉ_ij^(h)| summed over the window's queries and the query heads of each KV
    group; the window's own keys are always kept, and the first ``sinks`` tokens."""

    needs = ("window_contribution",)

    def of_window(self, stats: LayerStats) -> Tensor:
        return stats.contribution_of_window(self.window)
