"""Key norm (Devoto et al. 2024): a low key norm means keep (score = −‖k_j‖)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Method
from .stats import LayerStats, Scores


@dataclass(frozen=True)
class KNorm(Method):
    """Devoto et al. 2024: a low key norm means keep (score = −‖k_j‖)."""

    def score(self, stats: LayerStats) -> Scores:
        return -torch.linalg.vector_norm(stats.keys.float(), dim=-1).to(stats.keys.dtype)
