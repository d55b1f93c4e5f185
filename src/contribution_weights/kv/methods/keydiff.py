"""KeyDiff (Park et al. 2025): −cos(k_j, mean unit key of the head), the most distinctive
keys kept."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from .base import Method, _protect_first
from .stats import LayerStats, Scores


@dataclass(frozen=True)
class KeyDiff(Method):
    """Park et al. 2025: keep the most distinctive keys; score = −cos(k_j, k̄) with k̄ the
    mean of the head's unit keys (kvpress's anchor); the first ``sinks`` tokens always kept
    (the paper keeps none)."""

    sinks: int = 0

    def score(self, stats: LayerStats) -> Scores:
        keys = stats.keys.to(torch.promote_types(stats.keys.dtype, torch.float32))
        anchor = F.normalize(keys, dim=-1).mean(dim=2, keepdim=True)
        return _protect_first(-F.cosine_similarity(keys, anchor, dim=-1), self.sinks)
