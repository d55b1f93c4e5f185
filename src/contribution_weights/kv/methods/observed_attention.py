"""kvpress's form of H2O: the accumulated attention divided by the number of queries that
can see each key."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Method
from .stats import LayerStats, Scores


@dataclass(frozen=True)
class ObservedAttention(Method):
    """kvpress's H2O: accumulated attention / the number of queries that see the key."""

    needs = ("attn_sum",)

    def score(self, stats: LayerStats) -> Scores:
        attn = stats.need("attn_sum")
        t = stats.length
        seen_by = torch.arange(t, 0, -1, device=attn.device, dtype=attn.dtype)
        return stats.per_kv_head(attn / seen_by)
