"""TOVA (Oren et al. 2024): the last query's attention averaged over all heads of the
layer (one kept set per layer); the last key is always kept."""

from __future__ import annotations

from dataclasses import dataclass

from torch.nn import functional as F

from .base import Method
from .stats import LayerStats, Scores


@dataclass(frozen=True)
class TOVA(Method):
    """Oren et al. 2024: the last query's attention averaged over all heads of the layer
    (one kept set per layer); the last key is always kept."""

    needs = ("window_probs",)

    def score(self, stats: LayerStats) -> Scores:
        last = stats.probs_of_window(1)[:, :, -1, :-1].mean(1)  # (B, T-1), every head
        scores = last[:, None].expand(-1, stats.num_kv_heads, -1)
        return F.pad(scores, (0, 1), value=float(scores.max()) + 1)
