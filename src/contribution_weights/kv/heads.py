"""Per-KV-head masks for a compressed cache whose heads keep different numbers of entries.

A head-adaptive method (:class:`~.methods.AdaKV`) lets each KV head of a layer keep its
own count. The cache stays a dense ``(B, G, S, d_h)`` tensor: ``S`` slots per head, the
largest count over every compressed layer, head and batch row (one ``S`` for all of them,
because transformers sizes the attention mask of all full-attention layers from the first
one's cache length). A head that keeps fewer entries fills its remaining slots with zero
keys and values (*padded slots*, after its kept entries).

A padded slot must receive exactly zero attention in every later forward. transformers'
masks are ``(B, 1, Q, K)``, shared by the heads, so :func:`head_masked` switches the model,
for the duration of a forward or ``generate``, to an attention function registered through
transformers' ``AttentionInterface`` (as :mod:`~contribution_weights.capture` does) that
takes the mask the model built, adds the padded slots of each head to it
(:func:`with_padded_slots`: ``False`` in a boolean mask, the dtype's minimum in an additive
one, which is what the mask holds for any key a query may not see) and calls the
attention the model was using (sdpa, or the family's own eager function) with that
``(B, H, Q, K)`` mask. The softmax gives a masked key a weight of exactly 0 (the
exponential of ``−∞``, or of the dtype's minimum plus a finite logit, underflows to 0), so
the output equals attention over the kept keys alone. Layers without padded slots (all
layers of an equal-count method, sliding-window layers) get the model's own function and
mask unchanged; a cache without padded slots never switches the model at all.

Other implementations (flash attention, flex) take no per-head mask: a forward on a
padded cache runs on sdpa instead.
"""

from __future__ import annotations

import contextvars
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from ..families import UnsupportedModelError

#: the attention implementations registered here, by the one they add the mask to
NAMES = {
    "sdpa": "contribution_weights_kv_heads_sdpa",
    "eager": "contribution_weights_kv_heads_eager",
}

_PADDED: contextvars.ContextVar[Mapping[int, Tensor] | None] = contextvars.ContextVar(
    "contribution_weights_kv_padded", default=None
)
_registered = False


def with_padded_slots(
    attention_mask: Tensor | None, padded: Tensor, num_heads: int, q_len: int, k_len: int
) -> Tensor:
    """The model's attention mask with the padded slots of each KV head masked.

    Args:
        attention_mask: what the model passes its attention function: None (plain causal,
            the queries being the last ``q_len`` of ``k_len`` positions), a boolean mask
            (True = may attend) or an additive float mask, ``(B|1, 1, Q, K')``.
        padded: ``(B, G, S)`` True at the padded slots (the cache's first ``S`` entries).
        num_heads: query heads H (a multiple of G; query head h reads KV head h // (H/G)).

    Returns:
        ``(B, H, Q, K')``, of the mask's kind (boolean when there was none).
    """
    b, g, slots = padded.shape
    width = k_len if attention_mask is None else attention_mask.shape[-1]
    hidden = torch.zeros(b, g, width, dtype=torch.bool, device=padded.device)
    hidden[..., :slots] = padded
    hidden = hidden.repeat_interleave(num_heads // g, dim=1)[:, :, None, :]  # (B, H, 1, K')
    if attention_mask is None:
        q_pos = torch.arange(q_len, device=padded.device) + (k_len - q_len)
        causal = torch.arange(width, device=padded.device)[None, :] <= q_pos[:, None]
        return causal[None, None] & ~hidden
    hidden = hidden.to(attention_mask.device)
    if attention_mask.dtype == torch.bool:
        return attention_mask & ~hidden
    low = torch.tensor(torch.finfo(attention_mask.dtype).min, dtype=attention_mask.dtype)
    return torch.where(hidden, low.to(attention_mask.device), attention_mask)


def _model_attention(base: str, module: nn.Module) -> Callable[..., Any]:
    """The attention function a model in implementation ``base`` calls for ``module``."""
    if base == "eager":
        function = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if function is None:
            raise TypeError(
                f"{type(module).__name__} has no eager_attention_forward in its module; run the "
                "model on sdpa to continue on a cache whose KV heads keep different counts"
            )
        return function
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def _masking(base: str) -> Callable[..., Any]:
    def attention(
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        layer_idx = getattr(module, "layer_idx", None)
        if layer_idx is None:
            raise UnsupportedModelError(
                f"{type(module).__name__} has no layer_idx, so the padded slots of its cache "
                "layer cannot be found"
            )
        padded = (_PADDED.get() or {}).get(int(layer_idx))
        if padded is not None:
            attention_mask = with_padded_slots(
                attention_mask, padded, query.shape[1], query.shape[2], key.shape[2]
            )
        return _model_attention(base, module)(
            module, query, key, value, attention_mask, *args, **kwargs
        )

    attention.__name__ = f"head_masked_{base}"
    return attention


def ensure_registered() -> None:
    """Register the two attention functions and their mask functions (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    masks: dict[str, Callable[..., Any]] = {"sdpa": sdpa_mask, "eager": eager_mask}
    for base, name in NAMES.items():
        AttentionInterface.register(name, _masking(base))
        # the mask function of the implementation wrapped: without one registered under
        # the same name, transformers drops the causal mask
        AttentionMaskInterface.register(name, masks[base])
    _registered = True


@contextmanager
def head_masked(model: nn.Module, padded: Mapping[int, Tensor]) -> Iterator[None]:
    """Inside the block, ``model``'s attention hides the padded slots ``padded[layer]``
    ``(B, G, S)`` of each layer's KV heads (see the module docstring). With no padded
    slot anywhere it changes nothing. The model's implementation is restored after."""
    if not padded:
        yield
        return
    ensure_registered()
    config: Any = model.config
    previous = config._attn_implementation
    name = NAMES["eager" if previous == "eager" else "sdpa"]
    token = _PADDED.set(dict(padded))
    try:
        if previous != name:
            model.set_attn_implementation(name)  # type: ignore[operator]
        yield
    finally:
        _PADDED.reset(token)
        if config._attn_implementation != previous:
            model.set_attn_implementation(previous)  # type: ignore[operator]
