"""What an intervention changes in a layer's attention (:class:`AttentionEdit`), the
:class:`Intervention` protocol, and the arithmetic of the edits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from .layer import LayerCall


@dataclass
class AttentionEdit:
    """What an intervention changes in one layer's attention, per batch row, head and key
    (each ``(B, H, Tk)``; None: nothing of that kind).

    Attributes:
        scale: multipliers of the values, ṽ_j ← s_j ṽ_j. A 0 takes the token's value out
            without renormalising the weights (the removal of method §4, ``value_zero``).
        masked: keys that leave the softmax: the other weights renormalise, exactly as if
            the token's key and value were not in the cache (``key_mask``).
        replaced: values replaced by the mean value the query sees, the mean of v_k over
            the keys k it may attend to (so no later token leaks into an earlier
            prediction; ``mean_value``). ṽ = W_O v is linear, so this is the mean
            projected value of the head.
    """

    scale: Tensor | None = None
    masked: Tensor | None = None
    replaced: Tensor | None = None


class Intervention(Protocol):
    """Changes a layer's attention: ``edit(call)`` gives an :class:`AttentionEdit` or None.

    An older form is accepted too: ``column_scale(call)`` giving the ``(B, H, Tk)`` value
    multipliers alone.
    """

    def edit(self, call: LayerCall) -> AttentionEdit | None: ...


def _edit_of(intervention: Any, call: LayerCall) -> AttentionEdit | None:
    if intervention is None:
        return None
    if hasattr(intervention, "edit"):
        edit: AttentionEdit | None = intervention.edit(call)
        return edit
    scale = intervention.column_scale(call)
    return None if scale is None else AttentionEdit(scale=scale)


def _renormalised(probs: Tensor, masked: Tensor) -> Tensor:
    """``probs`` with the masked keys' weights set to 0 and each row renormalised over the
    rest: softmax over the kept keys only (a row with no key left is all 0; a row that
    loses no weight is left exactly as it was)."""
    gone = probs.masked_fill(~masked, 0.0).sum(-1, keepdim=True)
    kept = probs.masked_fill(masked, 0.0)
    total = kept.sum(-1, keepdim=True)
    scaled = torch.where(total > 0, kept / total.clamp_min(torch.finfo(kept.dtype).tiny), kept)
    return torch.where(gone > 0, scaled, probs)


def _visible_mean(call: LayerCall, rows: slice, values: Tensor) -> Tensor:
    """``(B, H, I, d)``: per query, the mean of the values over the keys it may attend to."""
    valid = call.valid(rows).to(values.dtype)  # (B, I, T)
    weights = valid / valid.sum(-1, keepdim=True).clamp_min(1.0)
    return torch.matmul(weights[:, None], values)
