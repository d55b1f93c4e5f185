"""``vatp_wo``: VATP with the norm of the projected value, ``S_j · ‖W_O^(h) v_j‖`` (the
value geometry of method §2, without the alignment term)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Method
from .stats import LayerStats, Scores


@dataclass(frozen=True)
class VATPProjected(Method):
    """VATP with the norm of the projected value, S_j · ‖W_O^(h) v_j‖."""

    needs = ("attn_sum", "projected_value_norm")

    def score(self, stats: LayerStats) -> Scores:
        return stats.per_kv_head(stats.need("attn_sum") * stats.need("projected_value_norm"))
