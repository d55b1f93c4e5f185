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

Head-adaptive methods (:class:`~.methods.AdaKV`) let the KV heads of a layer keep different
counts. The cache then has ``S`` slots per head, the largest count over every compressed
layer, head and batch row; a head that keeps fewer has zero-filled *padded slots* after
its kept entries (``kept`` holds −1 there), and :meth:`CompressedCache.forward` and
:meth:`CompressedCache.generate` run the model with an attention that gives those slots
exactly zero weight (:mod:`.heads`). Call the model through them (not directly) on such a
cache. Without padded slots (every equal-count method) nothing of this runs.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .heads import head_masked
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


def cache_keyword(model: Any) -> str:
    """The keyword a model's forward takes its cache by: ``cache`` in recent transformers,
    ``past_key_values`` before. The older releases take a ``cache=`` silently (into
    ``**kwargs``) and run without it, so the name must be the one the model reads.

    Read from the forward's signature, through ``torch.compile`` (``_orig_mod``), PEFT
    (``get_base_model()``) and ``functools.wraps`` decorators; a wrapper that hides both
    names behind ``**kwargs`` gets the installed transformers' own name (its generation
    code's)."""
    candidates = [model, getattr(model, "_orig_mod", None)]
    base = getattr(model, "get_base_model", None)
    if callable(base):
        candidates.append(base())
    for candidate in candidates:
        forward = getattr(candidate, "forward", None)
        if forward is None:
            continue
        try:
            params = inspect.signature(inspect.unwrap(forward)).parameters
        except (TypeError, ValueError):  # no signature to read
            continue
        for name in ("cache", "past_key_values"):
            if name in params:
                return name
    from transformers.generation.utils import GenerationMixin

    params = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in params else "past_key_values"


def _rows(input_ids: Tensor) -> Tensor:
    """New tokens as rows ``(B, n)``: a single row ``(n,)`` becomes ``(1, n)``."""
    rows = input_ids[None] if input_ids.ndim == 1 else input_ids
    if rows.ndim != 2 or rows.shape[1] == 0:
        raise ValueError(
            f"new tokens must be (batch, n) or (n,) ids with n >= 1, not shape "
            f"{tuple(input_ids.shape)}"
        )
    return rows


@dataclass
class CompressedCache:
    """A cache compressed after a prefill of ``length`` tokens.

    Attributes:
        cache: the transformers cache, ready to pass to the model (it grows as usual).
        length: the prefill length T: the position of the next token.
        kept: per compressed layer, ``(B, G, S)`` kept positions (ascending), one per cache
            slot; ``S = n_kept``, except after a head-adaptive method, where ``S`` is the
            largest count of any head and a head that keeps fewer has −1 at its padded
            slots (at the end). :attr:`counts` gives what each head really keeps.
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
        """Run ``model`` on new tokens ``(B, n)`` (or ``(n,)``, one row) after the cache
        (which then holds them too)."""
        input_ids = _rows(input_ids)
        seen = self.cache.get_seq_length(self._first_kept_layer())
        offset = seen - self._cached_after_prefill()
        pos = self.position_ids(input_ids.shape[1], offset).to(input_ids.device)
        with head_masked(model, self.padded()):
            cache = {cache_keyword(model): self.cache}
            return model(input_ids=input_ids, position_ids=pos, **cache, **kwargs)

    def generate(self, model: Any, input_ids: Tensor, **kwargs: Any) -> Tensor:
        """``model.generate`` on new tokens ``(B, n)`` (or ``(n,)``) after the prefill;
        returns the new tokens plus the generated ones, ``(B, n + generated)``.

        transformers infers what is already cached from the cache length, so the call is
        given as many placeholder tokens in front as it reads there (never run: they stand
        for the cached entries, padded slots included) and explicit positions that continue
        at the prefill length. It reads the length of layer 0, which a model whose first
        layer is not compressed (Gemma's sliding-window layers) holds in full: the
        placeholders follow that layer, not the compressed ones, or transformers would feed
        some of them to the model as tokens.
        """
        input_ids = _rows(input_ids)
        cached = self.cache.get_seq_length()  # what transformers' generate reads (layer 0)
        b, n = input_ids.shape
        reserve(self.cache, n + int(kwargs.get("max_new_tokens") or 0))
        filler = torch.zeros(b, cached, dtype=input_ids.dtype, device=input_ids.device)
        full = torch.cat([filler, input_ids], dim=1)
        seen = self.cache.get_seq_length(self._first_kept_layer())
        offset = seen - self._cached_after_prefill()
        positions = torch.cat(
            [torch.zeros(1, cached, dtype=torch.long), self.position_ids(n, offset)], dim=1
        ).expand(b, -1)
        with head_masked(model, self.padded()):
            out = model.generate(
                input_ids=full,
                attention_mask=torch.ones_like(full),
                position_ids=positions.to(input_ids.device),
                **{cache_keyword(model): self.cache},
                **kwargs,
            )
        return out[:, cached:]

    @property
    def counts(self) -> dict[int, Tensor]:
        """Per compressed layer, ``(B, G)``: the prefill entries each KV head really keeps
        (padded slots not counted; ``n_kept`` everywhere for an equal-count method)."""
        return {i: (k >= 0).sum(-1) for i, k in self.kept.items()}

    @property
    def entries_kept(self) -> int:
        """Prefill entries kept, over the compressed layers, KV heads and batch rows."""
        return int(sum(int((k >= 0).sum()) for k in self.kept.values()))

    @property
    def entries_stored(self) -> int:
        """Prefill slots the compressed layers store, padded slots included (equal to
        :attr:`entries_kept` unless the heads keep different counts)."""
        return int(sum(k.numel() for k in self.kept.values()))

    def padded(self) -> dict[int, Tensor]:
        """Per compressed layer with padded slots, ``(B, G, S)``: True at those slots."""
        return {i: k < 0 for i, k in self.kept.items() if bool((k < 0).any())}

    def _first_kept_layer(self) -> int:
        return min(self.kept) if self.kept else 0

    def _cached_after_prefill(self) -> int:
        if not self.kept:
            return self.length
        return int(self.kept[self._first_kept_layer()].shape[-1])


def reserve(cache: Any, extra: int) -> None:
    """Give every plain growing layer of ``cache`` (transformers' ``DynamicLayer``) room for
    ``extra`` more entries, so that generation writes each new token's key and value in
    place: a plain layer concatenates instead, copying its whole cache at every generated
    token (about 15% of a 4,096-token RULER item's time on SmolLM2). Other layer types
    (sliding windows) are left as they are."""
    from transformers.cache_utils import DynamicLayer

    reserved = _reserved_layer()
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, reserved):
            layer.make_room(extra)
        elif type(layer) is DynamicLayer and layer.get_seq_length() > 0:
            cache.layers[i] = reserved.around(layer, extra)


@functools.cache
def _reserved_layer() -> Any:
    """The class of :func:`reserve`'s layers (built on first use: transformers loads late)."""
    from transformers.cache_utils import DynamicLayer

    class ReservedLayer(DynamicLayer):
        """A ``DynamicLayer`` whose keys and values are the first ``used`` entries of
        larger buffers (``room``). Keys and values set from outside (a crop, a reset, a
        copy's) are adopted as the new room before anything is written."""

        room: tuple[Tensor, Tensor]
        used: int
        view: tuple[Any, Any]  # the keys and values this layer last set

        @classmethod
        def around(cls, layer: Any, extra: int) -> Any:
            new = cls.__new__(cls)
            new.__dict__.update(layer.__dict__)
            new.view = (None, None)
            new.make_room(extra)
            return new

        def __copy__(self) -> Any:
            # a shallow copy must not write into this layer's buffers: it adopts its
            # current views as its own room, which grows (copies) before any write
            new = type(self).__new__(type(self))
            new.__dict__.update(self.__dict__)
            new.view = (None, None)
            return new

        def _sync(self) -> None:
            if self.keys is not self.view[0] or self.values is not self.view[1]:
                keys: Any = self.keys
                values: Any = self.values
                self.room, self.used = (keys, values), int(keys.shape[-2])
                self.view = (self.keys, self.values)

        def _show(self, n: int) -> None:
            self.used = n
            self.keys, self.values = self.room[0][..., :n, :], self.room[1][..., :n, :]
            self.view = (self.keys, self.values)

        def make_room(self, extra: int) -> None:
            """Buffers with room for ``extra`` more entries after the ``used`` ones."""
            self._sync()
            n = self.used
            if n + extra > self.room[0].shape[-2]:
                k, v = (
                    torch.cat(
                        [old[..., :n, :], old.new_empty(*old.shape[:-2], extra, old.shape[-1])],
                        -2,
                    )
                    for old in self.room
                )
                self.room = (k, v)
            self._show(n)

        def update(
            self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
        ) -> tuple[Tensor, Tensor]:
            if not self.is_initialized or self.keys is None:  # after a reset: start plainly
                return super().update(key_states, value_states, *args, **kwargs)
            self._sync()
            n, m = self.used, key_states.shape[-2]
            if n + m > self.room[0].shape[-2]:  # more than reserved: grow by doubling
                self.make_room(max(m, n))
            self.room[0][..., n : n + m, :] = key_states
            self.room[1][..., n : n + m, :] = value_states
            self._show(n + m)
            return self.room[0][..., : n + m, :], self.room[1][..., : n + m, :]

    return ReservedLayer


def stackable(cache: CompressedCache) -> tuple[Any, ...] | None:
    """What compressed caches must share to be generated for in one batch
    (:func:`stack_caches`): the prefill length and every layer's kept shape; None for a
    cache with padded slots (a head-adaptive method), which generates alone."""
    if cache.padded():
        return None
    return cache.length, tuple((i, tuple(k.shape)) for i, k in sorted(cache.kept.items()))


def stack_caches(caches: Sequence[CompressedCache]) -> CompressedCache:
    """One cache whose batch rows are ``caches`` (compressed from one prefill of one
    sequence, each row its own method), so that one ``generate`` serves them all: each
    step reads the model's weights once for every row. Rows do not see each other; a row's
    tokens equal its own generation up to float rounding (the batched products may sum in
    another order). The rows are copies: generating extends the stacked cache only. One
    cache is returned as it is (any cache, padded slots included).
    """
    if not caches:
        raise ValueError("no caches to stack")
    if len(caches) == 1:
        return caches[0]
    key = stackable(caches[0])
    if key is None or any(stackable(c) != key for c in caches):
        raise ValueError(
            "caches stack only when they come from one prefill and keep the same number of "
            "entries in every layer, with no padded slots: "
            + ", ".join(f"{c.method} at {c.ratio}" for c in caches)
        )
    first = caches[0]
    cache = copy.copy(first.cache)
    cache.layers = [copy.copy(layer) for layer in first.cache.layers]
    for i, layer in enumerate(cache.layers):
        rows = [c.cache.layers[i] for c in caches]
        layer.keys = torch.cat([r.keys for r in rows])
        layer.values = torch.cat([r.values for r in rows])
    kept = {i: torch.cat([c.kept[i] for c in caches]) for i in first.kept}
    method = "+".join(c.method for c in caches)
    return CompressedCache(cache=cache, length=first.length, kept=kept, method=method,
                           ratio=first.ratio)  # fmt: skip


def kept_positions(scores: Tensor, ratio: float) -> Tensor:
    """``(B, G, T)`` scores → ``(B, G, n_kept)`` kept positions, ascending."""
    k = n_kept(scores.shape[-1], ratio)
    return scores.topk(k, dim=-1).indices.sort(dim=-1).values


def compress(prefill: Prefill, method: str | Method, ratio: float) -> CompressedCache:
    """A copy of ``prefill.cache`` with ``ratio`` of each KV head's entries evicted by ``method``.

    Ratio 0 returns an untouched copy. The prefill's cache itself is never changed, so one
    prefill serves every method and ratio. A head-adaptive method keeps ``G · n_kept``
    entries per layer with different counts per head (:func:`_gather_adaptive`).
    """
    ratio = check_ratio(ratio)
    spec = get_method(method)
    cache = copy.deepcopy(prefill.cache)
    result = CompressedCache(cache=cache, length=prefill.length, method=spec.name, ratio=ratio)
    if not prefill.stats:
        raise ValueError(
            "this model has no layer whose cache can be compressed (all are sliding-window)"
        )
    adaptive: dict[int, Tensor] = {}
    for idx, stats in prefill.stats.items():
        layer = cache.layers[idx]
        t = layer.keys.shape[-2]
        if ratio == 0:
            result.kept[idx] = torch.arange(t, device=layer.keys.device).expand(
                *layer.keys.shape[:2], t
            )
            continue
        if spec.head_adaptive:
            adaptive[idx] = spec.kept_mask(stats, n_kept(t, ratio))
            if adaptive[idx].shape != layer.keys.shape[:-1]:
                raise RuntimeError(
                    f"method {spec.name!r} kept a mask of shape {tuple(adaptive[idx].shape)} "
                    f"at layer {idx}, expected {tuple(layer.keys.shape[:-1])}"
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
    if adaptive:
        _gather_adaptive(cache, adaptive, result)
    return result


def _gather_adaptive(cache: Any, masks: dict[int, Tensor], result: CompressedCache) -> None:
    """Gather each layer's kept entries ``masks[layer]`` ``(B, G, T)`` into ``S`` slots per
    head, ``S`` the largest count anywhere (one for all layers: transformers sizes the mask
    of every full-attention layer from the first one's cache). A head's kept entries come
    first, in their original order; its padded slots after them hold zero keys and values
    and −1 in ``result.kept``."""
    slots = max(int(mask.sum(-1).max()) for mask in masks.values())
    for idx, mask in masks.items():
        layer = cache.layers[idx]
        t = mask.shape[-1]
        pos = torch.arange(t, device=mask.device).expand_as(mask)
        order = torch.where(mask, pos, pos + t).sort(dim=-1).values[..., :slots]
        real = order < t
        index = (order % t)[..., None].expand(-1, -1, -1, layer.keys.shape[-1])
        real_ = real[..., None]
        layer.keys = layer.keys.gather(2, index).masked_fill(~real_, 0).contiguous()
        layer.values = layer.values.gather(2, index).masked_fill(~real_, 0).contiguous()
        result.kept[idx] = torch.where(real, order, -1)
