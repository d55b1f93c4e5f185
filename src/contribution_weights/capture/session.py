"""One capture session: its observers, optional intervention and per-layer bookkeeping, and
the routing of each layer call to the eager recomputation, the tiled kernels or the
model's own attention kernel."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from ..families import FamilySpec
from ..measures.layer import split_output_weight
from .allocator import keep_freed_blocks
from .edits import Intervention, _edit_of, _renormalised, _visible_mean
from .layer import DEFAULT_BLOCK_BYTES, LayerBlock, LayerCall, rows_per_block


class Observer(Protocol):
    """Shown each block of queries of each layer it wants, as a :class:`LayerBlock`
    (the same object for every observer of the block, valid during the call only).

    Optional methods, looked up with ``getattr``: ``wants(layer_idx) -> bool`` (default:
    every layer), ``skipped(call)``, called for a layer that ran without observation, and
    ``query_rows(call) -> slice | None``: the only queries it needs to see (None: all).
    When every observer of a layer names its rows, the layer runs on the model's own sdpa
    kernel and only those rows' probabilities are computed, eagerly, for the observers.
    ``tiled(call) -> bool`` and ``observe_layer(call) -> Tensor``: an observer that reduces
    a whole layer from ``call``'s queries, keys and values, returning the head states
    ``(H, T, d_h)``; when every observer of a layer says ``tiled``, no block is built.
    """

    def observe(self, view: LayerBlock) -> None: ...


def _wants(observer: Observer, layer_idx: int) -> bool:
    wants = getattr(observer, "wants", None)
    return True if wants is None else bool(wants(layer_idx))


@dataclass
class CaptureSession:
    """One capture: its observers, optional intervention, and per-layer bookkeeping."""

    spec: FamilySpec
    observers: Sequence[Observer] = ()
    intervention: Intervention | None = None
    block_bytes: int = DEFAULT_BLOCK_BYTES
    #: the kernel of layers that nobody observes or changes: "sdpa" (the model's own, or
    #: the one our masks are made for when the model used another) or "eager" (our eager
    #: recomputation, bitwise the model's eager forward and the observed layers' arithmetic)
    kernel: str = "sdpa"
    layers_seen: list[int] = field(default_factory=list)
    _weights: dict[tuple[int, torch.dtype], tuple[Tensor, Tensor | None, Tensor]] = field(
        default_factory=dict
    )

    def output_projection(
        self, call: LayerCall, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        key = (call.layer_idx, dtype)
        if key not in self._weights:
            weight, bias = self.spec.output_weight(call.module)
            w_o = split_output_weight(weight.detach().to(call.query.device, dtype), call.num_heads)
            b_o = None if bias is None else bias.detach().to(call.query.device, dtype)
            gram = w_o.transpose(1, 2) @ w_o
            self._weights[key] = (w_o, b_o, gram)
        return self._weights[key]

    def attend(self, call: LayerCall) -> Tensor:
        self.layers_seen.append(call.layer_idx)
        # whichever path the layer takes, observers that do not want it are told so (once)
        # and shown nothing
        watching = [o for o in self.observers if _wants(o, call.layer_idx)]
        self._skip([o for o in self.observers if o not in watching], call)
        if self._untraced(call, watching):
            return self._sdpa(call)
        tiled = self._tiled(call, watching)
        if tiled is not None:
            return tiled
        wanted = self._wanted_rows(call, watching)
        if wanted is not None:
            return self._observed_rows(call, wanted, watching)
        blocks = call.row_blocks()
        if call.query.device.type == "cpu" and len(blocks) > 1:
            keep_freed_blocks()  # blocks of megabytes, freed and made again: reuse them
        if self.intervention is not None and len(blocks) == 1:
            # the intervention ranks tokens on this layer's probabilities: compute them once
            # and let it read them (LayerCall.probs) instead of recomputing them
            call.layer_probs = call.probs(blocks[0])
        edit = _edit_of(self.intervention, call)
        scale = None if edit is None else edit.scale
        values = call._expanded(call.value)
        if scale is not None:
            # α·diag(s)·V = α·(s ⊙ V): scale the values (T·d) rather than the probabilities (T²)
            values = values * scale[:, :, :, None].to(values.dtype)
        replaced = None if edit is None else edit.replaced
        kept_values = values
        if replaced is not None:
            kept_values = values.masked_fill(replaced[:, :, :, None], 0.0)
        # observers that take blocks narrowed to their keys' span (``key_spans = True``)
        # are shown only those keys, and nothing is computed for the keys outside it
        narrow = (
            call.layer_probs is None
            and edit is None
            and all(getattr(o, "key_spans", False) for o in watching)
        )
        outputs = []
        for rows in blocks:
            keys = call.key_span(rows) if narrow else None
            logits = None
            if call.layer_probs is not None:
                probs = call.layer_probs
            else:
                probs, logits = call.probs_and_logits(rows, keys=keys)
            if edit is not None and edit.masked is not None:
                probs = _renormalised(probs, edit.masked[:, :, None, :])
            block = torch.matmul(probs, kept_values if keys is None else kept_values[:, :, keys])
            if replaced is not None:
                # α_ij · mean_i(v) for the replaced keys j: their weight times the mean
                share = (probs * replaced[:, :, None, :].to(probs.dtype)).sum(-1, keepdim=True)
                block = block + share * _visible_mean(call, rows, values)
            if watching:
                if scale is not None:  # observers see the probabilities actually used
                    probs = probs * scale[:, :, None, :].to(probs.dtype)
                # the block's α·v is the layer's own unless values were replaced
                states = block if replaced is None else None
                if edit is not None:
                    logits = None  # the probabilities shown may no longer be their softmax
                shown = LayerBlock(call, rows, probs, keys=keys, states=states, logits=logits)
                try:
                    for observer in watching:
                        observer.observe(shown)
                finally:
                    shown.close()
            outputs.append(block)
        call.layer_probs = None
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
        return out.transpose(1, 2).contiguous()

    def _untraced(self, call: LayerCall, watching: Sequence[Observer]) -> bool:
        """Whether the layer runs on the model's own kernel: no intervention, no observer
        wants it (or there are none), and sdpa can compute it (no soft-cap) exactly as the
        model's forward does (the session's kernel is not eager)."""
        return (
            self.intervention is None
            and call.softcap is None
            and self.kernel != "eager"
            and not watching
        )

    def _tiled(self, call: LayerCall, watching: Sequence[Observer]) -> Tensor | None:
        """The layer for observers that reduce it whole from its queries, keys and values
        (``observe_layer``, no probabilities built: the tiled kernels of
        :mod:`~.measures.tiled`), when every observer of the layer can; else None. The
        layer's output is the head states they computed, ``(B, T, H, d_h)``."""
        if self.intervention is not None or not watching:
            return None
        if not all(getattr(o, "tiled", _never)(call) for o in watching):
            return None
        states = [o.observe_layer(call) for o in watching]  # type: ignore[attr-defined]
        return states[0].to(call.query.dtype)[None].transpose(1, 2).contiguous()

    def _wanted_rows(self, call: LayerCall, watching: Sequence[Observer]) -> slice | None:
        """The queries the observers of this layer need, when every one of them names its
        rows (``query_rows``) and nothing else needs the eager path; else None."""
        if (
            self.intervention is not None
            or call.softcap is not None
            or self.kernel == "eager"
            or not watching
        ):
            return None
        spans = []
        for observer in watching:
            rows_of = getattr(observer, "query_rows", None)
            rows = None if rows_of is None else rows_of(call)
            if rows is None:
                return None
            spans.append(rows)
        start, stop = min(r.start for r in spans), max(r.stop for r in spans)
        return slice(max(0, start), min(call.q_len, stop))

    def _observed_rows(
        self, call: LayerCall, wanted: slice, watching: Sequence[Observer]
    ) -> Tensor:
        """The layer on sdpa; the observers see eager probabilities of ``wanted`` only."""
        out = self._sdpa(call)
        step = max(1, rows_per_block(call.batch * call.num_heads, call.k_len, self.block_bytes))
        for start in range(wanted.start, wanted.stop, step):
            rows = slice(start, min(wanted.stop, start + step))
            shown = LayerBlock(call, rows, call.probs(rows))
            try:
                for observer in watching:
                    observer.observe(shown)
            finally:
                shown.close()
        return out

    def _sdpa(self, call: LayerCall) -> Tensor:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        out, _ = sdpa_attention_forward(
            call.module,
            call.query,
            call.key,
            call.value,
            call.attention_mask,
            dropout=0.0,
            scaling=call.scaling,
        )
        return out

    @staticmethod
    def _skip(observers: Sequence[Observer], call: LayerCall) -> None:
        """Tell ``observers`` the layer ran without their observation (``skipped``)."""
        for observer in observers:
            skipped = getattr(observer, "skipped", None)
            if skipped is not None:
                skipped(call)


def _never(call: LayerCall) -> bool:
    return False
