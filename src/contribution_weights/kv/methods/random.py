"""``random``: a seeded uniform draw."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Method
from .stats import LayerStats, Scores


@dataclass(frozen=True)
class Random(Method):
    """A seeded uniform draw."""

    def score(self, stats: LayerStats) -> Scores:
        gen = torch.Generator(device=stats.keys.device).manual_seed(stats.seed)
        shape = stats.keys.shape[:-1]
        return torch.rand(shape, generator=gen, device=stats.keys.device, dtype=torch.float64)
