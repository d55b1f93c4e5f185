"""Mean attention of the last ``window`` queries, without pooling: the attention analogue of
``contribution`` (same window, same heads)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Method, _protect_last, _window_keys
from .stats import LayerStats, Scores


@dataclass(frozen=True)
class WindowAttention(Method):
    """Mean attention of the window's queries, without pooling: contribution's attention
    control (same window, same heads); the window's own keys are always kept."""

    window: int | None = None
    needs = ("window_probs",)

    def score(self, stats: LayerStats) -> Scores:
        scores = stats.per_kv_head(stats.probs_of_window(self.window).mean(2))
        return _protect_last(scores, _window_keys(stats, self.window))
