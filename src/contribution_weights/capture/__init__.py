"""Getting attention internals out of a Hugging Face model, and changing them.

Mechanism. transformers routes every attention layer of the supported families through
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``. We register one function,
:func:`_attention`, under the name :data:`ATTN_IMPLEMENTATION` (with the eager mask
function under the same name, without which transformers silently drops the causal
mask), and switch a model to it only inside :func:`capturing`, which restores the
previous implementation (sdpa, flash, eager…) in ``finally``.

The function receives exactly what the model uses (queries and keys after RoPE and q/k
norms, values per KV head, ``scaling``, ``softcap``, the mask with any sliding window,
and the attention ``module``). For a layer that is observed or changed it recomputes
eager attention from them, so the observers see, and the logits come from, exactly the
model's own eager attention; every other layer runs the model's own kernel (sdpa), so a
capture with nothing to observe costs what the plain forward costs.

Lifetimes. A :class:`CaptureSession` lives for one ``with capturing(...)`` block; it is
found by the attention function through a context variable, so concurrent sessions in
other threads or tasks do not see each other. Per layer the function builds a
:class:`LayerCall` and hands the session:

* an optional :class:`Intervention`, asked once per layer for multipliers of the
  attention columns (``(B, H, T_k)``; multiplying column j by 0 removes ṽ_j from every
  query, method §4), and
* :class:`Observer` objects, each shown every block of queries as one :class:`LayerBlock`:
  the call, the query rows, the probabilities that were actually used, and the
  :class:`~.measures.layer.LayerTensors` built from them on first request per compute
  dtype (:meth:`LayerBlock.tensors`) and shared by every observer of the block, so the
  intermediates (``o_i``, ``⟨o_i, ṽ_j⟩``, norms) are computed once per block, not once
  per observer. Observers that set ``key_spans = True`` are shown, for each block, only
  the range of keys its queries can attend to (``LayerBlock.keys``; causal rows see no
  later key, sliding-window rows nothing before their window), which is all the work
  done: at long context, half the keys of a causal layer and nearly all of a
  sliding-window one are skipped. An observer may say which layers it wants (``wants(layer_idx)``);
  a layer that no observer wants and that no intervention changes is sent to the
  model's own kernel (``skipped(call)`` tells the observers; see :func:`capturing`), so
  tracing three layers of thirty costs little more than a plain forward.

Queries are processed in blocks (all at once when they fit in ``block_bytes``), so
memory per layer stays bounded at long context and no ``(H, T, T)`` tensor outlives its
layer unless an observer keeps it: a :class:`LayerBlock` drops its ``LayerTensors``
when its block has been shown to every observer (:meth:`LayerBlock.close`).
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn

from ..families import FamilySpec, UnsupportedModelError, family_for
from .edits import AttentionEdit, Intervention
from .layer import (
    DEFAULT_BLOCK_BYTES,
    BlockClosedError,
    CaptureError,
    LayerBlock,
    LayerCall,
    key_range,
    rows_per_block,
)
from .session import CaptureSession, Observer

__all__ = [
    "ATTN_IMPLEMENTATION",
    "DEFAULT_BLOCK_BYTES",
    "AttentionEdit",
    "BlockClosedError",
    "CaptureError",
    "CaptureSession",
    "Intervention",
    "LayerBlock",
    "LayerCall",
    "Observer",
    "capturing",
    "check_all_layers_seen",
    "ensure_registered",
    "key_range",
    "rows_per_block",
]

ATTN_IMPLEMENTATION = "contribution_weights"

_ACTIVE: contextvars.ContextVar[CaptureSession | None] = contextvars.ContextVar(
    "contribution_weights_session", default=None
)
_registered = False


def _layer_index(module: nn.Module) -> int:
    idx = getattr(module, "layer_idx", None)
    if idx is None:
        raise UnsupportedModelError(
            f"{type(module).__name__} has no layer_idx; capture needs it to tell layers apart"
        )
    return int(idx)


def _attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The registered attention function (see module docstring)."""
    session = _ACTIVE.get()
    if session is None:
        session = CaptureSession(spec=_fallback_spec(module))
    if kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None:
        raise UnsupportedModelError("learned attention sinks (s_aux) are not supported yet")
    call = LayerCall(
        module=module,
        layer_idx=_layer_index(module),
        query=query,
        key=key,
        value=value,
        attention_mask=attention_mask,
        scaling=query.shape[-1] ** -0.5 if scaling is None else float(scaling),
        softcap=softcap,
        spec=session.spec,
        session=session,
    )
    return session.attend(call), None


def _fallback_spec(module: nn.Module) -> FamilySpec:
    config = getattr(module, "config", None)
    return family_for(config)


def register_attention(name: str, function: Any, mask: str) -> None:
    """Register ``function`` with transformers as attention implementation ``name``, with
    transformers' ``mask`` (``"sdpa"`` or ``"eager"``) mask function."""
    from transformers import AttentionInterface, masking_utils

    AttentionInterface.register(name, function)
    masking_utils.AttentionMaskInterface.register(name, getattr(masking_utils, f"{mask}_mask"))


def ensure_registered() -> None:
    """Register the attention and mask functions with transformers (idempotent). sdpa's
    mask function: None for a plain causal mask (no T × T tensor is built; the attention
    function masks each block itself, exactly as eager's additive mask does), a bool mask
    where one is needed (sliding windows, padding)."""
    global _registered
    if not _registered:
        register_attention(ATTN_IMPLEMENTATION, _attention, "sdpa")
        _registered = True


@contextmanager
def capturing(
    model: nn.Module,
    observers: Sequence[Observer] = (),
    intervention: Intervention | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    kernel: str | None = None,
) -> Iterator[CaptureSession]:
    """Run ``model`` through the capture function inside the block; restore it after.

    Without an intervention, layers that no observer wants run on the model's own kernel:
    sdpa, or eager for a model that was set to eager (a model on another kernel, flash
    say, runs them on sdpa, the kernel the capture masks are made for; a nested capture
    takes the outer one's); a layer with a soft-cap runs eagerly, which sdpa cannot. With
    an intervention every layer is recomputed eagerly, edited or not, so that its outputs
    compare exactly with another intervention's. ``kernel="eager"`` recomputes every layer
    eagerly whatever the model uses, for callers that compare outputs of one capture with
    another to the last bit.

    The model is put in eval mode for the block (dropout off) and given back in the
    attention implementation and train/eval mode it had.
    """
    ensure_registered()
    config: Any = model.config
    spec = family_for(config)
    previous = config._attn_implementation
    if kernel not in (None, "eager", "sdpa"):
        raise ValueError(f"kernel={kernel!r}: use None (the model's own), 'sdpa' or 'eager'")
    session = CaptureSession(
        spec=spec,
        observers=observers,
        intervention=intervention,
        block_bytes=block_bytes,
        kernel=kernel or _own_kernel(previous),
    )
    was_training = model.training
    token = _ACTIVE.set(session)
    try:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)  # type: ignore[operator]
        if config._attn_implementation != ATTN_IMPLEMENTATION:
            raise CaptureError(
                f"{type(model).__name__} does not let its attention implementation be set, "
                "so its internals cannot be captured (it must use transformers' AttentionInterface)"
            )
        model.eval()
        yield session
    finally:
        _ACTIVE.reset(token)
        if config._attn_implementation != previous:
            model.set_attn_implementation(previous)  # type: ignore[operator]
        model.train(was_training)


def _own_kernel(previous: str) -> str:
    """The kernel of untraced layers for a model that used ``previous``: eager for an eager
    model, sdpa for the others; inside another capture, the outer session's."""
    if previous == ATTN_IMPLEMENTATION:
        outer = _ACTIVE.get()
        return "sdpa" if outer is None else outer.kernel
    return "eager" if previous == "eager" else "sdpa"


def check_all_layers_seen(session: CaptureSession, num_layers: int) -> None:
    """Fail loudly when some layer bypassed the capture function."""
    seen = sorted(set(session.layers_seen))
    if seen != list(range(num_layers)):
        missing = sorted(set(range(num_layers)) - set(seen))
        raise CaptureError(
            f"attention layers {missing} did not run through the capture function; "
            "the model may call its attention outside transformers' AttentionInterface"
        )
