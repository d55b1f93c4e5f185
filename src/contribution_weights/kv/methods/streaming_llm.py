"""StreamingLLM (Xiao et al. 2023): the first 4 tokens (sinks) plus the most recent ones."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import N_SINK, Method
from .stats import LayerStats, Scores


@dataclass(frozen=True)
class StreamingLLM(Method):
    """Xiao et al. 2023: the first ``sinks`` tokens plus the most recent ones."""

    sinks: int = N_SINK

    def score(self, stats: LayerStats) -> Scores:
        t = stats.length
        pos = torch.arange(t, device=stats.keys.device, dtype=torch.float64)
        scores = pos.expand(stats.keys.shape[0], stats.num_kv_heads, t).clone()
        scores[..., : self.sinks] = t + 1.0  # sinks outrank every recent token
        return scores
