"""Ours, exact: the change of each head's output when a key is evicted and the softmax
renormalises (:mod:`...renormalised`), summed over the window's queries and the group."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .base import WindowSum
from .stats import LayerStats


@dataclass(frozen=True)
class Renormalised(WindowSum):
    """Ours, exact: Σ over the window's queries and the query heads of each KV group of
    ‖Δo_ij^(h)‖ = α_ij ‖o_i^(h) − ṽ_j^(h)‖ / (1 − α_ij), how far evicting key j moves the
    head's projected output once the softmax renormalises over the rest (contribution
    measures the first-order change without renormalisation). The window's own keys are
    always kept, and the first ``sinks`` tokens."""

    needs = ("window_renormalised",)

    def of_window(self, stats: LayerStats) -> Tensor:
        return stats.renormalised_of_window(self.window)
