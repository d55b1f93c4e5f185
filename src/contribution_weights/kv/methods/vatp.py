"""VATP (Guo et al. 2024, value-aware token pruning): accumulated attention times the
value's L1 norm, ``S_j · ‖v_j‖₁``."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Method, _protect_first
from .stats import LayerStats, Scores


@dataclass(frozen=True)
class VATP(Method):
    """Guo et al. 2024: accumulated attention times the value's L1 norm, S_j · ‖v_j‖₁; the
    first ``sinks`` tokens always kept (the paper keeps 4)."""

    sinks: int = 0
    needs = ("attn_sum",)

    def score(self, stats: LayerStats) -> Scores:
        scores = stats.per_kv_head(stats.need("attn_sum")) * stats.values.abs().sum(-1)
        return _protect_first(scores, self.sinks)
