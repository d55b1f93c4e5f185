"""CriticalKV (Feng et al. 2025, kvpress's CriticalKVPress) on a base method: half the
budget by the base, the rest by the base × ‖W_O^(h) v_j‖."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Method, get_method, method_needs
from .stats import LayerStats, Scores


@dataclass(frozen=True)
class CriticalKV(Method):
    """Feng et al. 2025, as kvpress's CriticalKVPress: two stages on a base method's scores
    ``s_j`` within a budget of ``kept`` per KV head.

    Stage 1 keeps the ``⌊first_stage · kept⌋`` best by ``s_j``; stage 2 fills the rest by
    ``(s_j + epsilon) · ‖W_O^(h) v_j‖`` (the projected value norm, mean over the group's
    heads). kvpress uses the L1 norm of ``W_O^(h) v_j`` (the paper's bound); this uses the
    L2 norm the prefill gathers (``projected_value_norm``).
    """

    base: str | Method = "snapkv"
    first_stage: float = 0.5
    epsilon: float = 1e-4

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.first_stage <= 1:
            raise ValueError(f"method {self.name!r}: first_stage is a share of the budget")

    @property
    def base_method(self) -> Method:
        return get_method(self.base)

    @property
    def gathers(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*method_needs(self.base_method), "projected_value_norm")))

    @property
    def window_queries(self) -> int | None:
        return self.base_method.window_queries

    def score(self, stats: LayerStats) -> Scores:
        """Without a budget: the scores for keeping half (ratio 0.5)."""
        return self.score_for_budget(stats, max(1, stats.length // 2))

    def score_for_budget(self, stats: LayerStats, kept: int) -> Scores:
        base = self.base_method.score_for_budget(stats, kept)
        norm = stats.per_kv_head(stats.need("projected_value_norm"))
        scores = (base + self.epsilon) * norm
        first = min(kept, int(kept * self.first_stage))
        if first > 0:
            top = base.topk(first, dim=-1).indices
            scores = scores.scatter(-1, top, float(scores.max()) + 1)
        return scores
