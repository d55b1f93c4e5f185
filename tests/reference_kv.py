"""An independent reference for continuing from a compressed KV cache: the model's own
attention over the *uncompressed* cache, with each evicted prefill entry masked out per
KV head, in plain torch (a transformers attention function registered for the call)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from contribution_weights.kv import cache_keyword

REFERENCE = "kv_reference_test"
#: layer -> (B, G, T) bool, True where evicted; read by reference_attention
evicted_entries: dict[int, Tensor] = {}


def reference_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **_: Any,
) -> tuple[Tensor, None]:
    rep = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(rep, dim=1)
    v = value.repeat_interleave(rep, dim=1)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = query @ k.transpose(2, 3) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        mask = attention_mask[:, :, :, : k.shape[2]]
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask
    drop = evicted_entries.get(int(module.layer_idx))  # type: ignore[arg-type]
    if drop is not None:  # every query here is a continuation query
        hidden = torch.zeros_like(scores, dtype=torch.bool)
        hidden[..., : drop.shape[-1]] = drop.repeat_interleave(rep, dim=1)[:, :, None, :]
        scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return (probs @ v).transpose(1, 2).contiguous(), None


def reference_logits(
    model: nn.Module, cache: Any, new_ids: Tensor, drop: dict[int, Tensor]
) -> Tensor:
    """Logits of ``new_ids`` after ``cache`` (a prefill's, uncompressed) with the entries
    ``drop[layer]`` ``(B, G, T)`` evicted; the cache itself is not changed."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(REFERENCE, reference_attention)
    AttentionMaskInterface.register(REFERENCE, eager_mask)
    previous = model.config._attn_implementation
    evicted_entries.clear()
    evicted_entries.update(drop)
    try:
        model.set_attn_implementation(REFERENCE)
        with torch.no_grad():
            return model(input_ids=new_ids, **{cache_keyword(model): copy.deepcopy(cache)}).logits
    finally:
        evicted_entries.clear()
        model.set_attn_implementation(previous)


def greedy_tokens(cache: Any, model: Any, ids: Tensor, steps: int) -> Tensor:
    """``ids`` and ``steps`` greedy tokens after them, one ``cache.forward`` per token: the
    step-by-step loop that ``CompressedCache.generate`` must reproduce."""
    tokens = step = ids
    with torch.no_grad():
        for _ in range(steps):
            nxt = cache.forward(model, step).logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], dim=1)
            step = nxt
    return tokens
