"""Sinks: finding them as the forward pass goes, and scaling their value (method §5).

Sinks at layer l are token 0 and any token whose layer-input hidden state has a cosine
above ``threshold`` (0.95) with token 0's (:func:`sink_mask`). :func:`tracking_sinks` records
them for every decoder layer with forward pre-hooks that live only inside its ``with``
block; the :class:`SinkTracker` it yields is read, layer by layer during the same
forward, by removals that keep sinks out of the eligible tokens (:mod:`.removal`).

:class:`SinkValueScale` is an :class:`~..capture.Intervention` of its own: it multiplies
v_0 by γ_b in the given layers (batch row b), the paper's Figure 6c.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..capture import AttentionEdit, LayerCall
from ..defaults import SINK_COSINE  # light: the CLI shows it before torch
from ..families import family_for


def sink_mask(hidden: Tensor, threshold: float = SINK_COSINE) -> Tensor:
    """``(B, T)`` bool: token 0 and tokens whose hidden state has cosine > ``threshold`` with it."""
    h = hidden.float()
    cos = nn.functional.cosine_similarity(h, h[:, :1].expand_as(h), dim=-1)
    mask = cos > threshold
    mask[:, 0] = True
    return mask


@dataclass
class SinkTracker:
    """Sink masks per layer, filled by forward pre-hooks as the forward pass goes."""

    threshold: float = SINK_COSINE
    masks: dict[int, Tensor] = field(default_factory=dict)

    def mask(self, layer: int) -> Tensor:
        if layer not in self.masks:
            raise RuntimeError(
                f"no layer-input hidden state was seen for layer {layer}; the decoder layers "
                "found by the family spec are not the ones the model ran"
            )
        return self.masks[layer]

    def _hook(self, layer: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        self.masks[layer] = sink_mask(hidden.detach(), self.threshold)


@contextmanager
def tracking_sinks(model: nn.Module, threshold: float = SINK_COSINE) -> Iterator[SinkTracker]:
    """Record sink masks from every decoder layer's input; hooks removed in ``finally``."""
    layers = family_for(model.config).decoder_layers(model)
    tracker = SinkTracker(threshold)
    handles = []
    try:
        for idx, layer in enumerate(layers):

            def hook(_m: nn.Module, args: Any, kwargs: Any, idx: int = idx) -> None:
                tracker._hook(idx, args, kwargs)

            handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
        yield tracker
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class SinkValueScale:
    """Intervention: attention column 0 times ``gammas[b]`` in ``layers`` (batch item b)."""

    layers: frozenset[int]
    gammas: Tensor  # (B,)

    def edit(self, call: LayerCall) -> AttentionEdit | None:
        if call.layer_idx not in self.layers:
            return None
        scale = torch.ones(call.batch, call.num_heads, call.k_len, device=call.query.device)
        scale[:, :, 0] = self.gammas.to(scale.device)[:, None]
        return AttentionEdit(scale=scale)


__all__ = ["SinkTracker", "SinkValueScale", "sink_mask", "tracking_sinks"]
