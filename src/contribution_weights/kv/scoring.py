"""Scoring a prefill for KV-cache eviction, on the library's capture path.

:func:`prefill` runs the model once over the context inside
:func:`~contribution_weights.capture.capturing` with a :class:`StatsObserver`, and returns
the cache the model filled together with one :class:`~.methods.LayerStats` per
compressible layer. Every method in :mod:`.methods` is then a cheap function of those
statistics, so one prefill serves all methods and ratios.

Memory. Capture shows the observer the attention probabilities block by block (query
rows, see :mod:`~contribution_weights.capture`). The observer keeps, per layer, only
``(B, H, T)`` running sums (accumulated attention) and, for the rows of the last
``window`` queries, their ``(B, H, w, T)`` probabilities. The contribution ĉ is computed
through :meth:`LayerCall.layer_tensors` for those window rows only: nothing of size
``(H, T, T)`` is built beyond what capture itself builds for one block.

Sliding-window layers (Gemma 2/3, Mistral with a window) are not compressed: their cache
is already bounded by the window, and transformers sizes their attention masks from the
number of tokens seen, not the number cached. kvpress makes the same choice for Gemma 3.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..capture import LayerCall, capturing, check_all_layers_seen
from ..loading import LoadedModel
from ..measures.layer import contribution as contribution_weights
from .methods import WINDOW, LayerStats


@dataclass
class _Partial:
    attn_sum: Tensor
    window_probs: list[Tensor] = field(default_factory=list)
    window_contribution: Tensor | None = None
    projected_value_norm: Tensor | None = None
    keys: Tensor | None = None
    values: Tensor | None = None


class StatsObserver:
    """Collects :class:`LayerStats` inputs for the layers in ``layers`` (capture Observer)."""

    def __init__(self, layers: set[int], window: int = WINDOW) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1 query, got {window}")
        self.layers = layers
        self.window = window
        self.partial: dict[int, _Partial] = {}

    def observe(self, call: LayerCall, rows: slice, probs: Tensor) -> None:
        if call.layer_idx not in self.layers:
            return
        dtype = torch.promote_types(call.query.dtype, torch.float32)
        part = self.partial.get(call.layer_idx)
        if part is None:
            b, h, t = call.batch, call.num_heads, call.k_len
            part = _Partial(attn_sum=torch.zeros(b, h, t, dtype=dtype, device=probs.device))
            part.keys, part.values = call.key.detach(), call.value.detach()
            self.partial[call.layer_idx] = part
        part.attn_sum += probs.detach().to(dtype).sum(2)
        start = max(rows.start, call.q_len - min(self.window, call.q_len))
        if start >= rows.stop:
            return
        sub = slice(start, rows.stop)
        block = probs.detach()[:, :, start - rows.start :]
        part.window_probs.append(block.to(dtype))
        lt = call.layer_tensors(sub, block, dtype)
        c = contribution_weights(lt).abs().sum(2)  # (B, H, T): Σ over these window rows
        previous = part.window_contribution
        part.window_contribution = c if previous is None else previous + c
        if part.projected_value_norm is None:
            part.projected_value_norm = lt.value_norm

    def stats(self, seed: int) -> dict[int, LayerStats]:
        out = {}
        for idx, part in sorted(self.partial.items()):
            assert part.keys is not None and part.values is not None
            assert part.window_contribution is not None and part.projected_value_norm is not None
            out[idx] = LayerStats(
                keys=part.keys,
                values=part.values,
                attn_sum=part.attn_sum,
                window_probs=torch.cat(part.window_probs, dim=2),
                window_contribution=part.window_contribution,
                projected_value_norm=part.projected_value_norm,
                seed=seed + idx,
            )
        return out


def compressible_layers(cache: object) -> list[int]:
    """Indices of the cache layers that hold every past token (not sliding-window ones)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(
            f"{type(cache).__name__} is not a transformers Cache with per-layer storage; "
            "pass the DynamicCache the model returned"
        )
    return [i for i, layer in enumerate(layers) if not getattr(layer, "is_sliding", False)]


@dataclass
class Prefill:
    """A scored prefill: the model's cache, its logits, and statistics per compressible layer."""

    ids: Tensor  # (B, T)
    cache: Any  # transformers Cache
    logits: Tensor  # (B, 1, V): the next-token logits after the prefill
    stats: dict[int, LayerStats]
    window: int

    @property
    def length(self) -> int:
        return int(self.ids.shape[1])


def _sliding_layer_ids(model: LoadedModel) -> set[int]:
    types = getattr(model.text_config, "layer_types", None) or []
    return {i for i, kind in enumerate(types) if "sliding" in str(kind)}


def prefill(
    model: LoadedModel,
    ids: Tensor,
    window: int = WINDOW,
    *,
    seed: int = 0,
) -> Prefill:
    """Run ``ids`` ``(T,)`` or ``(B, T)`` through the model, keeping its cache and the stats
    every registered method needs (one capture pass)."""
    if ids.dim() == 1:
        ids = ids[None]
    if ids.shape[1] < 2:
        raise ValueError("a prefill needs at least 2 tokens to compress")
    net = model.model
    layers = set(range(model.num_layers)) - _sliding_layer_ids(model)
    observer = StatsObserver(layers, window)
    ids = ids.to(net.device)
    with torch.no_grad(), capturing(net, observers=[observer]) as session:
        out = net(input_ids=ids, use_cache=True, **model.last_logits_only())
    check_all_layers_seen(session, model.num_layers)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    kept = set(compressible_layers(cache))
    stats = {i: s for i, s in observer.stats(seed).items() if i in kept}
    return Prefill(ids=ids, cache=cache, logits=out.logits, stats=stats, window=window)
