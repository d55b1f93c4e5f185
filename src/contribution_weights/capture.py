"""Getting attention internals out of a Hugging Face model, and changing them.

Mechanism. transformers routes every attention layer of the supported families through
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``. We register one function,
:func:`_attention`, under the name :data:`ATTN_IMPLEMENTATION` (with the eager mask
function under the same name, without which transformers silently drops the causal
mask), and switch a model to it only inside :func:`capturing`, which restores the
previous implementation (sdpa, flash, eager…) in ``finally``.

The function receives exactly what the model uses (queries and keys after RoPE and q/k
norms, values per KV head, ``scaling``, ``softcap``, the mask with any sliding window,
and the attention ``module``) and recomputes eager attention from them, so with capture
on, logits are those of the model's own eager attention.

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
  model's own sdpa kernel (``skipped(call)`` tells the observers), so tracing three
  layers of thirty costs little more than a plain forward.

Queries are processed in blocks (all at once when they fit in ``block_bytes``), so
memory per layer stays bounded at long context and no ``(H, T, T)`` tensor outlives its
layer unless an observer keeps it: a :class:`LayerBlock` drops its ``LayerTensors``
when its block has been shown to every observer (:meth:`LayerBlock.close`).
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from .families import FamilySpec, UnsupportedModelError, family_for
from .measures.layer import LayerTensors, split_output_weight

ATTN_IMPLEMENTATION = "contribution_weights"
DEFAULT_BLOCK_BYTES = 32 * 1024**2

_ACTIVE: contextvars.ContextVar[CaptureSession | None] = contextvars.ContextVar(
    "contribution_weights_session", default=None
)
_registered = False


def rows_per_block(rows_of_keys: int, num_keys: int, block_bytes: int) -> int:
    """Queries per block: ``rows_of_keys`` (batch × heads) score rows of ``num_keys`` keys
    each, counted at 8 bytes an element so that float64 measures stay within the bound."""
    return max(1, block_bytes // max(1, rows_of_keys * num_keys * 8))


class CaptureError(RuntimeError):
    """The model did not run its attention through the capture function."""


@dataclass
class LayerCall:
    """What the model handed the attention function for one layer."""

    module: nn.Module
    layer_idx: int
    query: Tensor  # (B, H, Tq, d_h)
    key: Tensor  # (B, G, Tk, d_h)
    value: Tensor  # (B, G, Tk, d_h)
    attention_mask: Tensor | None  # (B|1, 1, Tq, >=Tk), additive float or bool
    scaling: float
    softcap: float | None
    spec: FamilySpec
    session: CaptureSession
    # every query's probabilities (B, H, Tq, Tk), computed once before the intervention is
    # asked for its scale when the layer fits one block; :meth:`probs` reads them from here
    layer_probs: Tensor | None = None

    @property
    def batch(self) -> int:
        return self.query.shape[0]

    @property
    def num_heads(self) -> int:
        return self.query.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.key.shape[1]

    @property
    def q_len(self) -> int:
        return self.query.shape[2]

    @property
    def k_len(self) -> int:
        return self.key.shape[2]

    def row_blocks(self) -> list[slice]:
        step = rows_per_block(self.batch * self.num_heads, self.k_len, self.session.block_bytes)
        return [slice(s, min(self.q_len, s + step)) for s in range(0, self.q_len, step)]

    def _expanded(self, x: Tensor) -> Tensor:
        rep = self.num_heads // self.num_kv_heads
        if rep == 1:
            return x
        b, g, t, d = x.shape
        return x[:, :, None].expand(b, g, rep, t, d).reshape(b, g * rep, t, d)

    def key_span(self, rows: slice) -> slice:
        """The keys any query of ``rows`` may attend to, as one range ``[k0, k1)``.

        Causal rows ``q0 … q1−1`` see no key past ``q1−1`` and, in a sliding-window layer,
        none before the first row's window: probabilities outside the span are exactly 0,
        so work on them can be skipped. Read off the mask (the whole batch's union).
        """
        t = self.k_len
        seen_first = self.valid(slice(rows.start, rows.start + 1))[:, 0].any(0)
        seen_last = self.valid(slice(rows.stop - 1, rows.stop))[:, 0].any(0)
        if not bool(seen_first.any()) or not bool(seen_last.any()):
            return slice(0, t)
        k0 = int(seen_first.int().argmax())
        k1 = t - int(seen_last.flip(0).int().argmax())
        return slice(0, t) if k1 <= k0 else slice(k0, k1)

    def probs(self, rows: slice, batch: Tensor | None = None, keys: slice | None = None) -> Tensor:
        """``(B, H, I, K)`` attention probabilities for query rows, as eager computes them.

        ``batch``: indices of the batch rows wanted (all when None); only those are computed.
        ``keys``: a range of keys (all when None); outside :meth:`key_span` every
        probability is 0, so the range's probabilities equal those of the whole row.
        """
        if self.layer_probs is not None:  # computed once for the layer (intervention path)
            whole = self.layer_probs if keys is None else self.layer_probs[..., keys]
            return _take_rows(whole[:, :, rows], batch)
        keys = slice(0, self.k_len) if keys is None else keys
        query, key = self.query[:, :, rows], self.key[:, :, keys]
        if batch is not None:
            query, key = query.index_select(0, batch), key.index_select(0, batch)
        keys_ = self._expanded(key)
        mask = self.attention_mask
        if mask is not None:
            mask = mask[:, :, rows, keys]
            if batch is not None and mask.shape[0] > 1:
                mask = mask.index_select(0, batch)
        else:
            mask = self._causal_block(rows, keys, query.dtype)
        scores = self._fused_scores(query, keys_, mask)
        if scores is None:
            scores = torch.matmul(query, keys_.transpose(2, 3)) * self.scaling
            if self.softcap is not None:
                scores = torch.tanh(scores / self.softcap) * self.softcap
            if mask is not None:
                if mask.dtype == torch.bool:
                    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
                else:
                    scores = scores + mask
        if self.spec.softmax_float32:
            return nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(self.query.dtype)
        return nn.functional.softmax(scores, dim=-1).type(self.value.dtype)

    def _causal_block(self, rows: slice, keys: slice, dtype: torch.dtype) -> Tensor:
        """``(1, 1, I, K)`` additive causal mask of a block (0 where key ≤ query, else the
        dtype's minimum), what eager's mask holds there: the mask function gave None for
        a plain causal layer instead of a ``T × T`` tensor."""
        later = ~self.valid(rows, keys=keys)[:1]  # with no mask, valid() is the causal rule
        block = torch.zeros(later.shape, dtype=dtype, device=later.device)
        return block.masked_fill_(later, torch.finfo(dtype).min)[:, None]

    def _fused_scores(self, query: Tensor, keys: Tensor, mask: Tensor | None) -> Tensor | None:
        """``scaling · QKᵀ + mask`` in one ``baddbmm``, where that is exactly eager's
        ``(QKᵀ · scaling) + mask``: a power-of-two scaling (exact, so one rounding either
        way), no soft-cap, one sequence and an additive mask. Else None."""
        if self.softcap is not None or mask is None or mask.dtype != query.dtype:
            return None
        if query.shape[0] != 1 or mask.shape[0] != 1 or math.frexp(self.scaling)[0] != 0.5:
            return None
        _, h, i, d = query.shape
        t = keys.shape[2]
        scores = torch.baddbmm(
            mask[0],
            query.reshape(h, i, d),
            keys.reshape(h, t, d).transpose(1, 2),
            alpha=self.scaling,
        )
        return scores.view(1, h, i, t)

    def valid(self, rows: slice, batch: Tensor | None = None, keys: slice | None = None) -> Tensor:
        """``(B, I, K)`` bool: where each query may attend (``batch``: those rows only;
        ``keys``: that range of keys only)."""
        b = self.batch if batch is None else int(batch.numel())
        t = self.k_len
        keys = slice(0, t) if keys is None else keys
        i, k = rows.stop - rows.start, keys.stop - keys.start
        mask = self.attention_mask
        if mask is None:
            q_pos = torch.arange(rows.start, rows.stop, device=self.query.device) + (t - self.q_len)
            key_pos = torch.arange(keys.start, keys.stop, device=self.query.device)
            causal = key_pos[None, :] <= q_pos[:, None]
            return causal.expand(b, i, k)
        mask = mask[:, 0, rows, keys]
        if batch is not None and mask.shape[0] > 1:
            mask = mask.index_select(0, batch)
        ok = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
        return ok.expand(b, i, k)

    def output_blocks(self, dtype: torch.dtype) -> tuple[Tensor, Tensor | None, Tensor]:
        """Per-head ``W_O`` blocks ``(H, d, d_h)``, bias and Gram matrices, in ``dtype``."""
        return self.session.output_projection(self, dtype)

    def layer_tensors(
        self,
        rows: slice,
        probs: Tensor,
        dtype: torch.dtype,
        batch: Tensor | None = None,
        keys: slice | None = None,
        states: Tensor | None = None,
    ) -> LayerTensors:
        """The pure-maths view of this layer for a block of queries, in ``dtype``.

        ``batch`` selects batch rows (``probs`` must then hold just those rows), as for
        :meth:`probs` and :meth:`valid`; ``keys`` a range of keys (``probs`` then holds
        just those; the measures come out ``(…, K)`` for keys ``keys.start …``).
        ``states``: ``α @ v`` of ``probs`` ``(B, H, I, d_h)`` where the caller has it (the
        attention function computed it for the model's output), used when it is in ``dtype``.

        Observers do not call this: :meth:`LayerBlock.tensors` does, once per block and
        dtype, for all of them.
        """
        w_o, b_o, gram = self.output_blocks(dtype)
        if states is not None and states.dtype != dtype:
            states = None
        values = self.value if keys is None else self.value[:, :, keys]
        values = values if batch is None else values.index_select(0, batch)
        return LayerTensors(
            probs.to(dtype),
            values.to(dtype),
            w_o,
            b_o,
            self.valid(rows, batch, keys),
            gram=gram,
            head_states=states,
        )


def _take_rows(x: Tensor, batch: Tensor | None) -> Tensor:
    """Batch rows ``batch`` of ``x`` (a view when they are consecutive, else a copy)."""
    if batch is None:
        return x
    n = int(batch.numel())
    first = int(batch[0]) if n else 0
    if n and bool((batch == torch.arange(first, first + n, device=batch.device)).all()):
        return x.narrow(0, first, n)
    return x.index_select(0, batch.to(x.device))


class BlockClosedError(RuntimeError):
    """A :class:`LayerBlock` was asked for tensors after its block was over."""


@dataclass(eq=False)
class LayerBlock:
    """One layer call and one block of its query rows: what every observer is shown.

    Capture builds one per block and hands the same object to each observer, so the
    observers share its :meth:`tensors`: one :class:`LayerTensors` per (dtype, query
    rows) and block, built on first request by :meth:`LayerCall.layer_tensors`, instead
    of one per observer. The probabilities cover the keys ``keys`` and the batch rows
    ``batch``; the tensors are built over the same. When every observer has seen the
    block, capture calls :meth:`close`: the cached tensors are dropped (memory stays
    bounded by one block) and later requests fail.

    Outside observation, a caller holding probabilities of its own (token removal
    scoring its query blocks) builds a block the same way and reads :meth:`tensors`.
    """

    call: LayerCall
    rows: slice  # the query rows, [q0, q1)
    probs: Tensor  # (B|n, H, I, K): the probabilities the model used for these rows
    keys: slice | None = None  # the keys ``probs`` covers, [k0, k1) (None: all)
    batch: Tensor | None = None  # the batch rows ``probs`` holds (None: all)
    states: Tensor | None = None  # α @ v of ``probs`` (B, H, I, d_h), where computed already
    _tensors: dict[tuple[torch.dtype, int, int], LayerTensors] | None = field(
        default_factory=dict, init=False, repr=False
    )

    @property
    def layer_idx(self) -> int:
        return self.call.layer_idx

    @property
    def key_range(self) -> slice:
        """The keys ``probs`` covers as a range: ``keys``, or all of the layer's."""
        return slice(0, self.call.k_len) if self.keys is None else self.keys

    @property
    def is_open(self) -> bool:
        """Whether the block is still being shown (its tensors can be read)."""
        return self._tensors is not None

    def tensors(self, dtype: torch.dtype, rows: slice | None = None) -> LayerTensors:
        """The block's :class:`LayerTensors` in ``dtype``, built once and shared.

        ``rows``: a sub-range of :attr:`rows` (say the last queries of a window), built
        from those rows of :attr:`probs`; default all of them.
        """
        if self._tensors is None:
            raise BlockClosedError(
                f"layer {self.layer_idx}, queries {self.rows.start}:{self.rows.stop}: the "
                "block is over and its tensors are gone; read them inside observe()"
            )
        rows = self.rows if rows is None else rows
        if not self.rows.start <= rows.start <= rows.stop <= self.rows.stop:
            raise ValueError(
                f"queries {rows.start}:{rows.stop} are not inside the block's "
                f"{self.rows.start}:{self.rows.stop}"
            )
        key = (dtype, rows.start, rows.stop)
        lt = self._tensors.get(key)
        if lt is None:
            probs, states = self.probs, self.states
            if rows != self.rows:
                start = rows.start - self.rows.start
                probs, states = probs[:, :, start : start + rows.stop - rows.start], None
            lt = self.call.layer_tensors(
                rows, probs, dtype, batch=self.batch, keys=self.keys, states=states
            )
            self._tensors[key] = lt
        return lt

    def close(self) -> None:
        """The block is over: drop the cached tensors (capture calls this)."""
        self._tensors = None
        self.states = None


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


@dataclass
class CaptureSession:
    """One capture: its observers, optional intervention, and per-layer bookkeeping."""

    spec: FamilySpec
    observers: Sequence[Observer] = ()
    intervention: Intervention | None = None
    block_bytes: int = DEFAULT_BLOCK_BYTES
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
        if (
            self.intervention is None
            and self.observers
            and call.softcap is None
            and not any(_wants(o, call.layer_idx) for o in self.observers)
        ):
            return self._unobserved(call)
        tiled = self._tiled(call)
        if tiled is not None:
            return tiled
        wanted = self._wanted_rows(call)
        if wanted is not None:
            return self._observed_rows(call, wanted)
        blocks = call.row_blocks()
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
            and all(getattr(o, "key_spans", False) for o in self.observers)
        )
        outputs = []
        for rows in blocks:
            keys = call.key_span(rows) if narrow else None
            if call.layer_probs is not None:
                probs = call.layer_probs
            else:
                probs = call.probs(rows, keys=keys)
            if edit is not None and edit.masked is not None:
                probs = _renormalised(probs, edit.masked[:, :, None, :])
            block = torch.matmul(probs, kept_values if keys is None else kept_values[:, :, keys])
            if replaced is not None:
                # α_ij · mean_i(v) for the replaced keys j: their weight times the mean
                share = (probs * replaced[:, :, None, :].to(probs.dtype)).sum(-1, keepdim=True)
                block = block + share * _visible_mean(call, rows, values)
            if self.observers:
                if scale is not None:  # observers see the probabilities actually used
                    probs = probs * scale[:, :, None, :].to(probs.dtype)
                # the block's α·v is the layer's own unless values were replaced
                states = block if replaced is None else None
                shown = LayerBlock(call, rows, probs, keys=keys, states=states)
                try:
                    for observer in self.observers:
                        observer.observe(shown)
                finally:
                    shown.close()
            outputs.append(block)
        call.layer_probs = None
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
        return out.transpose(1, 2).contiguous()

    def _tiled(self, call: LayerCall) -> Tensor | None:
        """The layer for observers that reduce it whole from its queries, keys and values
        (``observe_layer``, no probabilities built: the tiled kernels of
        :mod:`~.measures.tiled`), when every observer of the layer can; else None. The
        layer's output is the head states they computed, ``(B, T, H, d_h)``."""
        if self.intervention is not None or not self.observers:
            return None
        watching = [o for o in self.observers if _wants(o, call.layer_idx)]
        if not watching or not all(getattr(o, "tiled", _never)(call) for o in watching):
            return None
        states = [o.observe_layer(call) for o in watching]  # type: ignore[attr-defined]
        return states[0].to(call.query.dtype)[None].transpose(1, 2).contiguous()

    def _wanted_rows(self, call: LayerCall) -> slice | None:
        """The queries the observers of this layer need, when every one of them names its
        rows (``query_rows``) and nothing else needs the eager path; else None."""
        if self.intervention is not None or call.softcap is not None or not self.observers:
            return None
        spans = []
        for observer in self.observers:
            if not _wants(observer, call.layer_idx):
                continue
            rows_of = getattr(observer, "query_rows", None)
            rows = None if rows_of is None else rows_of(call)
            if rows is None:
                return None
            spans.append(rows)
        if not spans:
            return None
        start, stop = min(r.start for r in spans), max(r.stop for r in spans)
        return slice(max(0, start), min(call.q_len, stop))

    def _observed_rows(self, call: LayerCall, wanted: slice) -> Tensor:
        """The layer on sdpa; the observers see eager probabilities of ``wanted`` only."""
        out = self._sdpa(call)
        step = max(1, rows_per_block(call.batch * call.num_heads, call.k_len, self.block_bytes))
        for start in range(wanted.start, wanted.stop, step):
            rows = slice(start, min(wanted.stop, start + step))
            shown = LayerBlock(call, rows, call.probs(rows))
            try:
                for observer in self.observers:
                    if _wants(observer, call.layer_idx):
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

    def _unobserved(self, call: LayerCall) -> Tensor:
        """A layer nobody observes or changes: the model's own sdpa kernel."""
        out = self._sdpa(call)
        for observer in self.observers:
            skipped = getattr(observer, "skipped", None)
            if skipped is not None:
                skipped(call)
        return out


def _never(call: LayerCall) -> bool:
    return False


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


def ensure_registered() -> None:
    """Register the attention and mask functions with transformers (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, _attention)
    # sdpa's mask function: None for a plain causal mask (no T × T tensor is built; the
    # attention function masks each block itself, exactly as eager's additive mask does),
    # a bool mask where one is needed (sliding windows, padding)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    _registered = True


@contextmanager
def capturing(
    model: nn.Module,
    observers: Sequence[Observer] = (),
    intervention: Intervention | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> Iterator[CaptureSession]:
    """Run ``model`` through the capture function inside the block; restore it after.

    The model is put in eval mode for the block (dropout off) and given back in the
    attention implementation and train/eval mode it had.
    """
    ensure_registered()
    config: Any = model.config
    spec = family_for(config)
    session = CaptureSession(
        spec=spec, observers=observers, intervention=intervention, block_bytes=block_bytes
    )
    previous = config._attn_implementation
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


def check_all_layers_seen(session: CaptureSession, num_layers: int) -> None:
    """Fail loudly when some layer bypassed the capture function."""
    seen = sorted(set(session.layers_seen))
    if seen != list(range(num_layers)):
        missing = sorted(set(range(num_layers)) - set(seen))
        raise CaptureError(
            f"attention layers {missing} did not run through the capture function; "
            "the model may call its attention outside transformers' AttentionInterface"
        )
