"""SnapKV (Li et al. 2024): attention of the last ``window`` queries, averaged over them,
smoothed by a 1-D average pool (kernel 5, as kvpress); the window's own keys are always kept."""

from __future__ import annotations

from dataclasses import dataclass

from torch.nn import functional as F

from .base import Method, _window_keys
from .stats import LayerStats, Scores

KERNEL = 5


@dataclass(frozen=True)
class SnapKV(Method):
    """Li et al. 2024: the window's attention averaged over its queries, smoothed by an
    average pool of ``kernel``; the window's own keys are always kept."""

    window: int | None = None
    kernel: int = KERNEL
    needs = ("window_probs",)

    def score(self, stats: LayerStats) -> Scores:
        w = _window_keys(stats, self.window)
        probs = stats.probs_of_window(self.window)[:, :, -w:, : stats.length - w]
        scores = probs.mean(dim=-2)
        pad = self.kernel // 2
        scores = F.avg_pool1d(scores, kernel_size=self.kernel, padding=pad, stride=1)
        scores = stats.per_kv_head(scores)
        return F.pad(scores, (0, w), value=float(scores.max()) + 1)
