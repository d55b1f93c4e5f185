"""AdaKV (Feng et al. 2024, kvpress's AdaKVPress) on any base method: the layer's budget
shared by its KV heads."""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch
from torch import Tensor

from .base import Method, get_method, method_needs
from .stats import LayerStats, Scores


@dataclass(frozen=True)
class AdaKV(Method):
    """Feng et al. 2024 (AdaKV), as kvpress's AdaKVPress: head-adaptive budgets within a
    layer, on any base method's scores.

    The layer keeps ``G · kept`` entries per batch row, shared by its G KV heads. Each head
    first keeps its ``⌈alpha_safeguard · kept⌉`` best entries by the base's scores (the
    safeguard, rounded up: 0.2 of 12 is 3); the rest of the layer's budget goes to the best
    remaining entries of all heads together, compared by the base's scores as they are
    (kvpress's choice: a head whose scores are larger takes more). Positions the base
    protects (its window, sinks) score above every entry of the layer in every registered
    method, so they stay kept whenever the per-head budget holds them. With
    ``alpha_safeguard = 1`` every head keeps exactly its base's own set.
    """

    base: str | Method = "snapkv"
    alpha_safeguard: float = 0.20
    head_adaptive = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.alpha_safeguard <= 1:
            raise ValueError(
                f"method {self.name!r}: alpha_safeguard is a share of each head's budget in [0, 1]"
            )

    @property
    def base_method(self) -> Method:
        return get_method(self.base)

    @property
    def gathers(self) -> tuple[str, ...]:
        return method_needs(self.base_method)

    @property
    def window_queries(self) -> int | None:
        return self.base_method.window_queries

    def safeguard(self, kept: int) -> int:
        """Entries each head keeps at least: ``⌈alpha_safeguard · kept⌉`` (the share taken
        as the decimal it was written, so 0.7 of 10 is 7), at most ``kept``."""
        return min(kept, math.ceil(Fraction(str(self.alpha_safeguard)) * kept))

    def score(self, stats: LayerStats) -> Scores:
        """The base's scores (what the heads compete by)."""
        return self.base_method.score(stats)

    def score_for_budget(self, stats: LayerStats, kept: int) -> Scores:
        return self.base_method.score_for_budget(stats, kept)

    def kept_mask(self, stats: LayerStats, kept: int) -> Tensor:
        scores = self.score_for_budget(stats, kept)
        b, g, t = scores.shape
        kept = min(kept, t)
        safe = self.safeguard(kept)
        keep = torch.zeros(b, g, t, dtype=torch.bool, device=scores.device)
        if safe > 0:
            keep.scatter_(-1, scores.topk(safe, dim=-1).indices, True)
        rest = g * (kept - safe)
        if rest > 0:
            # a score of −∞ stays above every entry already kept (those become −∞ here)
            finite = scores.double().clamp_min(torch.finfo(torch.float64).min)
            free = finite.masked_fill(keep, float("-inf")).reshape(b, g * t)
            keep.view(b, g * t).scatter_(-1, free.topk(rest, dim=-1).indices, True)
        return keep
