"""One layer's attention call as the capture function receives it (:class:`LayerCall`), and
one block of its queries as every observer is shown it (:class:`LayerBlock`): the
probabilities eager computes, key spans, validity masks and the shared
:class:`~..measures.layer.LayerTensors` of a block."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import torch
from torch import Tensor, nn

from ..families import FamilySpec
from ..measures.layer import LayerTensors, value_norms

DEFAULT_BLOCK_BYTES = 32 * 1024**2


class CaptureError(RuntimeError):
    """The model did not run its attention through the capture function, or ran it in a
    way capture cannot follow."""


class Session(Protocol):
    """What a :class:`LayerCall` asks of its capture session."""

    block_bytes: int

    def output_projection(
        self, call: LayerCall, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor | None, Tensor]: ...


def rows_per_block(rows_of_keys: int, num_keys: int, block_bytes: int) -> int:
    """Queries per block: ``rows_of_keys`` (batch × heads) score rows of ``num_keys`` keys
    each, counted at 8 bytes an element so that float64 measures stay within the bound."""
    return max(1, block_bytes // max(1, rows_of_keys * num_keys * 8))


@dataclass
class Logits:
    """A block's scores ``s`` ``(B, H, I, K)`` (the dtype's minimum where masked) and their
    softmax ``probs``; :attr:`lse`, each row's log-sum-exp ``(B, H, I)``, is made on first
    read (observers that never read it cost nothing): ``ln α_ij = s_ij − lse_i`` wherever
    α_ij > 0."""

    scores: Tensor
    probs: Tensor

    @cached_property
    def lse(self) -> Tensor:
        """``s_m − ln α_m`` at each row's largest score, whose probability is the largest
        (at least 1/K, so its log is well conditioned). A score of ``-inf`` makes a NaN of
        ``0 · s``: readers check for it."""
        best = self.probs.amax(-1)  # two max passes: faster than one that also finds where
        tiny = torch.finfo(best.dtype).tiny
        return self.scores.amax(-1) - torch.log(best.clamp_min(tiny))


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
    session: Session
    # every query's probabilities (B, H, Tq, Tk), computed once before the intervention is
    # asked for its scale when the layer fits one block; :meth:`probs` reads them from here
    layer_probs: Tensor | None = None
    # the sizes, read off the query (B, H, Tq) and the keys (G, Tk)
    batch: int = field(init=False)
    num_heads: int = field(init=False)
    q_len: int = field(init=False)
    num_kv_heads: int = field(init=False)
    k_len: int = field(init=False)
    # ‖ṽ_j^(h)‖ of every key by dtype, made once for the layer's blocks (:meth:`value_norms`)
    _value_norms: dict[torch.dtype, Tensor] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.batch, self.num_heads, self.q_len = self.query.shape[:3]
        self.num_kv_heads, self.k_len = self.key.shape[1:3]

    def row_blocks(self) -> list[slice]:
        step = rows_per_block(self.batch * self.num_heads, self.k_len, self.session.block_bytes)
        return [slice(s, min(self.q_len, s + step)) for s in range(0, self.q_len, step)]

    def mask_blocks(self) -> list[slice]:
        """Blocks of query rows whose ``(B, rows, keys)`` masks stay within the session's
        ``block_bytes`` (a mask row per batch row, where a block of scores has one per head)."""
        step = rows_per_block(self.batch, self.k_len, self.session.block_bytes)
        return [slice(s, min(self.q_len, s + step)) for s in range(0, self.q_len, step)]

    def key_ranges(self) -> tuple[Tensor, Tensor]:
        """Every query's ``[start, stop)`` of keys (``(Tq,)`` int32 each, batch row 0), read
        off the mask block by block: what the tiled kernels take."""
        ranges = [key_range(self.valid(rows)[0], self.layer_idx) for rows in self.mask_blocks()]
        return torch.cat([r[0] for r in ranges]), torch.cat([r[1] for r in ranges])

    def _expanded(self, x: Tensor) -> Tensor:
        rep = self.num_heads // self.num_kv_heads
        if rep == 1:
            return x
        b, g, t, d = x.shape
        return x[:, :, None].expand(b, g, rep, t, d).reshape(b, g * rep, t, d)

    @cached_property
    def head_keys(self) -> Tensor:
        """``(B, H, Tk, d_h)``: the keys per query head, expanded once for the layer's
        blocks (each block reads the range of keys it sees)."""
        return self._expanded(self.key)

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
        return self.probs_and_logits(rows, batch, keys)[0]

    def probs_and_logits(
        self, rows: slice, batch: Tensor | None = None, keys: slice | None = None
    ) -> tuple[Tensor, Logits | None]:
        """:meth:`probs`, and the scores they are the softmax of with each row's
        log-sum-exp (:class:`Logits`, so that ``ln α = s − lse`` needs no log pass) where
        the probabilities are those scores' float32 softmax (else None)."""
        if self.layer_probs is not None:  # computed once for the layer (intervention path)
            whole = self.layer_probs if keys is None else self.layer_probs[..., keys]
            return _take_rows(whole[:, :, rows], batch), None
        keys = slice(0, self.k_len) if keys is None else keys
        query = self.query[:, :, rows]
        if batch is not None:
            query = query.index_select(0, batch)
            keys_ = self._expanded(self.key[:, :, keys].index_select(0, batch))
        else:
            keys_ = self.head_keys[:, :, keys]
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
            probs = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(self.query.dtype)
        else:
            probs = nn.functional.softmax(scores, dim=-1).type(self.value.dtype)
        if scores.dtype != torch.float32 or probs.dtype != torch.float32:
            return probs, None
        return probs, Logits(scores, probs)

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
        logits: Logits | None = None,
    ) -> LayerTensors:
        """The pure-maths view of this layer for a block of queries, in ``dtype``.

        ``batch`` selects batch rows (``probs`` must then hold just those rows), as for
        :meth:`probs` and :meth:`valid`; ``keys`` a range of keys (``probs`` then holds
        just those; the measures come out ``(…, K)`` for keys ``keys.start …``).
        ``states``: ``α @ v`` of ``probs`` ``(B, H, I, d_h)`` where the caller has it (the
        attention function computed it for the model's output), used when it is in ``dtype``.
        ``logits``: the scores ``probs`` are the softmax of (:class:`Logits`), kept on the
        tensors when they are in ``dtype``.

        Observers do not call this: :meth:`LayerBlock.tensors` does, once per block and
        dtype, for all of them.
        """
        w_o, b_o, gram = self.output_blocks(dtype)
        if states is not None and states.dtype != dtype:
            states = None
        values = self.value if keys is None else self.value[:, :, keys]
        values = values if batch is None else values.index_select(0, batch)
        norms = None
        if batch is None:
            norms = self.value_norms(dtype)
            norms = norms if keys is None else norms[..., keys]
        lt = LayerTensors(
            probs.to(dtype),
            values.to(dtype),
            w_o,
            b_o,
            self.valid(rows, batch, keys),
            gram=gram,
            head_states=states,
            value_norm=norms,
        )
        if logits is not None and logits.scores.dtype == dtype and batch is None:
            lt.logits = logits
        return lt

    def value_norms(self, dtype: torch.dtype) -> Tensor:
        """``(B, H, T)``: ‖ṽ_j^(h)‖ of every key in ``dtype``, computed once for the layer
        (a key-side vector that every block of queries reads a range of)."""
        if dtype not in self._value_norms:
            gram = self.output_blocks(dtype)[2]
            self._value_norms[dtype] = value_norms(self.value.to(dtype), gram)
        return self._value_norms[dtype]


def key_range(valid: Tensor, layer: int) -> tuple[Tensor, Tensor]:
    """Per query of ``valid`` ``(I, K)``, the first and one-past-last key it may attend to;
    the keys between must all be allowed (causal and sliding-window masks are; others are
    refused)."""
    t = valid.shape[-1]
    count = valid.sum(-1)
    start = valid.int().argmax(-1)
    stop = t - valid.flip(-1).int().argmax(-1)
    stop = torch.where(count > 0, stop, start)
    if not bool((stop - start == count).all()):
        raise CaptureError(
            f"layer {layer}: some query attends to keys that are not one contiguous range "
            "(a padded or packed batch?); trace one unpadded sequence at a time"
        )
    return start.to(torch.int32), stop.to(torch.int32)


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
    logits: Logits | None = None  # the scores ``probs`` are the softmax of, where kept
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
            probs, states, logits = self.probs, self.states, self.logits
            if rows != self.rows:
                start = rows.start - self.rows.start
                probs, states = probs[:, :, start : start + rows.stop - rows.start], None
                logits = None
            lt = self.call.layer_tensors(
                rows, probs, dtype, batch=self.batch, keys=self.keys, states=states, logits=logits
            )
            self._tensors[key] = lt
        return lt

    def close(self) -> None:
        """The block is over: drop the cached tensors (capture calls this)."""
        self._tensors = None
        self.states = None
        self.logits = None
