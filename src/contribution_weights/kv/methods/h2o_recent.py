"""H2O as its paper runs it: part of the budget the most recent tokens, the rest the heavy
hitters by accumulated attention."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Method, _protect_last
from .stats import LayerStats, Scores


@dataclass(frozen=True)
class H2ORecent(Method):
    """H2O as its paper runs it: the budget split between the most recent tokens and the
    heavy hitters (accumulated attention over every prefill query, group mean).

    Of a budget of ``kept`` entries per KV head, the last ``⌊recent · kept⌋`` positions are
    kept and the other ``kept − ⌊recent · kept⌋`` are the best by accumulated attention
    among the older ones (the paper's 50/50 split by default).
    """

    recent: float = 0.5
    needs = ("attn_sum",)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.recent <= 1:
            raise ValueError(f"method {self.name!r}: recent is a share of the budget in [0, 1]")

    def recent_tokens(self, kept: int) -> int:
        """Positions of the recent window within a budget of ``kept``."""
        return min(kept, int(kept * self.recent))

    def score(self, stats: LayerStats) -> Scores:
        """Without a budget: the scores for keeping half (ratio 0.5)."""
        return self.score_for_budget(stats, max(1, stats.length // 2))

    def score_for_budget(self, stats: LayerStats, kept: int) -> Scores:
        scores = stats.per_kv_head(stats.need("attn_sum"))
        return _protect_last(scores, self.recent_tokens(kept))
