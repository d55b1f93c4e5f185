"""H2O (Zhang et al. 2023): attention accumulated over every prefill query."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Method
from .stats import LayerStats, Scores


@dataclass(frozen=True)
class H2O(Method):
    """Zhang et al. 2023: attention accumulated over every prefill query."""

    needs = ("attn_sum",)

    def score(self, stats: LayerStats) -> Scores:
        return stats.per_kv_head(stats.need("attn_sum"))
