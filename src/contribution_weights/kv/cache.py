"""Compressing a transformers cache, and continuing from it with the right positions.

:func:`compress` keeps, per compressible layer and KV head, the ``n_kept`` best-scored
entries (``n_kept = max(1, int(T · (1 − ratio)))``, kvpress's rule), gathered per head in
their original order. Each KV head may keep a different set of positions; the count is
the same for all, so the cache stays a dense ``(B, G, n_kept, d_h)`` tensor.

Positions. Keys are cached after RoPE, so a kept key keeps its rotation. New tokens
continue at position ``T`` (the prefill length), not at the cache length: pass
:meth:`CompressedCache.position_ids` to the model, or use :meth:`CompressedCache.forward`
and :meth:`CompressedCache.generate`, which do so. The attention mask is sized by
transformers from the cache itself (its length is ``n_kept``), which is what we want.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .methods import Method, get_method
from .scoring import Prefill


def check_ratio(ratio: float) -> float:
    """A compression ratio (fraction of entries removed) in [0, 1), else a clear error."""
    try:
        value = float(ratio)
    except (TypeError, ValueError):
        raise ValueError(f"compression ratio must be a number in [0, 1), not {ratio!r}") from None
    if math.isnan(value) or not 0 <= value < 1:
        raise ValueError(
            f"compression ratio is the fraction of cache entries removed and must lie in "
            f"[0, 1); got {ratio!r} (0 = no compression, 0.75 = keep a quarter)"
        )
    return value


def n_kept(length: int, ratio: float) -> int:
    """Entries kept per KV head out of ``length`` at ``ratio`` (kvpress's rule)."""
    return max(1, int(length * (1 - check_ratio(ratio))))


@dataclass
class CompressedCache:
    """A cache compressed after a prefill of ``length`` tokens.

    Attributes:
        cache: the transformers cache, ready to pass to the model (it grows as usual).
        length: the prefill length T: the position of the next token.
        kept: per compressed layer, ``(B, G, n_kept)`` kept positions (ascending).
        method, ratio: how it was compressed.
    """

    cache: Any
    length: int
    kept: dict[int, Tensor] = field(default_factory=dict)
    method: str = ""
    ratio: float = 0.0

    def position_ids(self, n: int, offset: int = 0) -> Tensor:
        """``(1, n)`` positions of ``n`` new tokens, ``offset`` tokens after the prefill."""
        start = self.length + offset
        return torch.arange(start, start + n)[None]

    def forward(self, model: Any, input_ids: Tensor, **kwargs: Any) -> Any:
        """Run ``model`` on new tokens ``(B, n)`` after the cache (which then holds them too)."""
        seen = self.cache.get_seq_length(self._first_kept_layer())
        offset = seen - self._cached_after_prefill()
        pos = self.position_ids(input_ids.shape[1], offset).to(input_ids.device)
        return model(input_ids=input_ids, cache=self.cache, position_ids=pos, **kwargs)

    def generate(self, model: Any, input_ids: Tensor, **kwargs: Any) -> Tensor:
        """``model.generate`` on new tokens ``(B, n)`` after the prefill; returns the new tokens
        plus the generated ones, ``(B, n + generated)``.

        transformers infers what is already cached from the cache length, so the call is
        given ``n_kept`` placeholder tokens in front (never run: they stand for the cached
        entries) and explicit positions that continue at the prefill length.
        """
        cached = self.cache.get_seq_length(self._first_kept_layer())
        b, n = input_ids.shape
        filler = torch.zeros(b, cached, dtype=input_ids.dtype, device=input_ids.device)
        full = torch.cat([filler, input_ids], dim=1)
        offset = cached - self._cached_after_prefill()
        positions = torch.cat(
            [torch.zeros(1, cached, dtype=torch.long), self.position_ids(n, offset)], dim=1
        ).expand(b, -1)
        out = model.generate(
            input_ids=full,
            attention_mask=torch.ones_like(full),
            position_ids=positions.to(input_ids.device),
            cache=self.cache,
            **kwargs,
        )
        return out[:, cached:]

    def _first_kept_layer(self) -> int:
        return min(self.kept) if self.kept else 0

    def _cached_after_prefill(self) -> int:
        if not self.kept:
            return self.length
        return int(next(iter(self.kept.values())).shape[-1])


def kept_positions(scores: Tensor, ratio: float) -> Tensor:
    """``(B, G, T)`` scores → ``(B, G, n_kept)`` kept positions, ascending."""
    k = n_kept(scores.shape[-1], ratio)
    return scores.topk(k, dim=-1).indices.sort(dim=-1).values


def compress(prefill: Prefill, method: str | Method, ratio: float) -> CompressedCache:
    """A copy of ``prefill.cache`` with ``ratio`` of each KV head's entries evicted by ``method``.

    Ratio 0 returns an untouched copy. The prefill's cache itself is never changed, so one
    prefill serves every method and ratio.
    """
    ratio = check_ratio(ratio)
    spec = get_method(method)
    cache = copy.deepcopy(prefill.cache)
    result = CompressedCache(cache=cache, length=prefill.length, method=spec.name, ratio=ratio)
    if not prefill.stats:
        raise ValueError(
            "this model has no layer whose cache can be compressed (all are sliding-window)"
        )
    for idx, stats in prefill.stats.items():
        layer = cache.layers[idx]
        t = layer.keys.shape[-2]
        if ratio == 0:
            result.kept[idx] = torch.arange(t, device=layer.keys.device).expand(
                *layer.keys.shape[:2], t
            )
            continue
        scores = spec.score_for_budget(stats, n_kept(t, ratio))
        if scores.shape != layer.keys.shape[:-1]:
            raise RuntimeError(
                f"method {spec.name!r} scored shape {tuple(scores.shape)} at layer {idx}, "
                f"expected {tuple(layer.keys.shape[:-1])}"
            )
        keep = kept_positions(scores, ratio)
        index = keep[..., None].expand(-1, -1, -1, layer.keys.shape[-1])
        layer.keys = layer.keys.gather(2, index).contiguous()
        layer.values = layer.values.gather(2, index).contiguous()
        result.kept[idx] = keep
    return result
