"""Triton kernels of the tiled reductions (see :mod:`.tiled`, which launches them).

Imported only by :func:`.tiled.kernels`, which builds them compiled (GPUs) or for
Triton's interpreter (CPU tensors: how the tests run them; the interpreter must be chosen
before triton is first imported, as its own library functions are built then). Every
kernel works on one head and a tile of queries or keys at a time and never holds more
than a ``BLOCK_M × BLOCK_N`` tile of any map:

* :func:`forward`: FlashAttention's online softmax, giving each query's log-sum-exp and
  head state ``z_i = Σ_j α_ij v_j`` in float32;
* :func:`rows` and :func:`cols`, the fused pair: every requested measure at once. Per
  tile, α (from ``QKᵀ`` and the log-sum-exp), ``p`` (``⟨W_Oᵀ o_i/‖o_i‖², v_j⟩``) and
  ``p^(h)`` are computed once, with ``tl.dot`` on tensor cores where the precision allows,
  and every measure's tile is made from them in registers: ``rows`` walks a tile of
  queries along its keys (row sums, the entropies' sums, the key-0 entry and the top keys
  of every measure), ``cols`` a tile of keys along the queries that see it (column sums,
  of the values and of their magnitudes). Two launches per layer whatever the number of
  measures, instead of atomics: deterministic sums, in the same order on every run.

Measures sit in up to :data:`SLOTS` slots (constexpr ``M0 … M7``: a measure's number or
-1 for an empty slot); their outputs are stacked by slot. ``DOT`` is the precision of the
products: 0 IEEE float32, 1 TF32 (tensor cores, 10-bit mantissa inputs), 2 bfloat16
operands (given as bfloat16 tensors); accumulation is float32 in every case. Under the
interpreter (``INTERPRET``) TF32 and bfloat16 products are emulated: the launcher rounds
the operands to the precision first, and the kernel multiplies them in float32, which is
what the tensor cores compute from such operands.

Measures by number (``MEASURE``): 0 attention α, 1 contribution α·p, 2 intra α·p^(h),
3 projection p, 4 cosine p·‖o_i‖/‖ṽ_j‖, 5 vw α·‖ṽ_j‖, 6 vw_on α·‖ṽ_j‖/‖o_i‖,
7 ihc |α·p|,
where ``p_ij = ⟨W_Oᵀ o_i/‖o_i‖², v_j⟩`` and ``p^(h)_ij = ⟨Gram_h z_i/‖o_i^(h)‖², v_j⟩``.
"""

# mypy: ignore-errors
# ruff: noqa: SIM108  (an if on a constexpr is resolved when Triton compiles)

from __future__ import annotations

from types import SimpleNamespace
from typing import no_type_check

import triton
import triton.language as tl


def build() -> SimpleNamespace:
    """The kernels: compiled by Triton, or run by its interpreter where ``TRITON_INTERPRET``
    was set when triton was first imported (:func:`.tiled.kernels` sees to it)."""
    return SimpleNamespace(
        forward=triton.jit(_forward), rows=triton.jit(_rows), cols=triton.jit(_cols)
    )


#: measures one launch of the fused pair serves (the launcher splits longer lists)
SLOTS = 8


@no_type_check  # jitted by build(); left alone by the tests' jaxtyping hook
def _forward(
    Q, K, V, START, STOP, KEY_LO, KEY_HI, Z, LSE,
    num_q, num_k, dim, group, scaling, softcap,
    s_qh, s_qt, s_kh, s_kt, s_zh, s_zt,
    SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0).to(tl.int64)  # 64-bit offsets: H · T · d_h may pass 2^31
    # the last query tiles see the most keys: started first, they do not form the tail
    tile = tl.num_programs(1) - 1 - tl.program_id(1)
    kv = h // group
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < num_q
    dim_ok = dims < dim
    q = tl.load(
        Q + h * s_qh + rows[:, None] * s_qt + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    start = tl.load(START + rows, mask=row_ok, other=0)
    stop = tl.load(STOP + rows, mask=row_ok, other=0)
    lo = tl.load(KEY_LO + tile)
    hi = tl.load(KEY_HI + tile)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < num_k
        kv_mask = col_ok[:, None] & dim_ok[None, :]
        k = tl.load(K + kv * s_kh + cols[:, None] * s_kt + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + kv * s_kh + cols[:, None] * s_kt + dims[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scaling
        if SOFTCAP:
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * (s / softcap)) + 1.0))  # softcap·tanh
        valid = (cols[None, :] >= start[:, None]) & (cols[None, :] < stop[:, None])
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.where(valid, tl.exp(s - m_safe[:, None]), 0.0)
        rescale = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_safe))
        total = total * rescale + tl.sum(p, 1)
        acc = acc * rescale[:, None] + tl.dot(p, v, input_precision="ieee")
        m = m_new
    seen = total > 0
    safe_total = tl.where(seen, total, 1.0)
    lse = tl.where(seen, m + tl.log(safe_total), float("-inf"))
    tl.store(LSE + h * num_q + rows, lse, mask=row_ok)
    tl.store(
        Z + h * s_zh + rows[:, None] * s_zt + dims[None, :],
        acc / safe_total[:, None],
        mask=row_ok[:, None] & dim_ok[None, :],
    )


@no_type_check  # the tests' jaxtyping hook must leave Triton's helpers alone
@triton.jit
def _dot(a, b, DOT: tl.constexpr, INTERPRET: tl.constexpr):
    """``a @ b`` with float32 accumulation in the precision ``DOT`` (module docstring)."""
    if INTERPRET or DOT == 0:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif DOT == 1:
        out = tl.dot(a, b, input_precision="tf32")
    else:
        out = tl.dot(a, b)  # bfloat16 operands: tensor cores, float32 accumulator
    return out


@no_type_check  # the tests' jaxtyping hook must leave Triton's helpers alone
@triton.jit
def _weight(M: tl.constexpr, alpha, p, ph, vnorm, onorm, valid):
    """Measure ``M``'s tile from the tile's α, p, p^(h) and the norms."""
    if M == 0:
        w = alpha
    elif M == 1:
        w = alpha * p
    elif M == 2:
        w = alpha * ph
    elif M == 3:
        w = p
    elif M == 4:
        inv_v = tl.where(vnorm > 0, 1.0 / tl.where(vnorm > 0, vnorm, 1.0), 0.0)
        w = tl.where(valid, p * onorm[:, None] * inv_v[None, :], 0.0)
    elif M == 5:
        w = alpha * vnorm[None, :]
    elif M == 6:
        inv_o = tl.where(onorm > 0, 1.0 / tl.where(onorm > 0, onorm, 1.0), 0.0)
        w = alpha * vnorm[None, :] * inv_o[:, None]
    else:
        w = tl.abs(alpha * p)
    if M == 1 or M == 2 or M == 3 or M == 4:  # signed
        a = tl.abs(w)
    else:
        a = w
    return w, a


@no_type_check  # the tests' jaxtyping hook must leave Triton's helpers alone
@triton.jit
def _row_state(BLOCK_M: tl.constexpr, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr):
    """A measure's per-query accumulators: row sum, Σ_{j≥1} a, Σ_{j≥1} a ln a, a_i0, w_i0,
    and the kept top keys (|w|, w, key), padded slots holding +inf (never replaced)."""
    slots = tl.arange(0, TOPK_PAD)
    zero = tl.zeros((BLOCK_M,), tl.float32)
    top_a = tl.where(slots[None, :] < TOPK, -1.0, float("inf")) + tl.zeros(
        (BLOCK_M, TOPK_PAD), tl.float32
    )
    top_w = tl.zeros((BLOCK_M, TOPK_PAD), tl.float32)
    top_i = tl.zeros((BLOCK_M, TOPK_PAD), tl.int32)
    return zero, zero, zero, zero, zero, top_a, top_w, top_i


@no_type_check  # the tests' jaxtyping hook must leave Triton's helpers alone
@triton.jit
def _fold_rows(
    M: tl.constexpr, w, a, cols, valid, n0, state,
    TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Fold one tile of measure ``M`` into its per-query accumulators ``state``."""
    acc, rest, rest_log, first, first_value, top_a, top_w, top_i = state
    acc += tl.sum(w, 1)
    is_first = cols[None, :] == 0
    later = tl.where(is_first, 0.0, a)
    rest += tl.sum(later, 1)
    rest_log += tl.sum(tl.where(later > 0, later * tl.log(tl.where(later > 0, later, 1.0)), 0.0), 1)
    first += tl.sum(tl.where(is_first, a, 0.0), 1)
    first_value += tl.sum(tl.where(is_first, w, 0.0), 1)
    if TOPK > 0 and M != 3 and M != 4:  # weights keep top keys
        # the TOPK largest a of the tile enter the kept set where they beat its smallest
        # member: TOPK rounds of (max, argmax), each masking its pick; skipped (one scalar
        # test) when no row's best beats its kept set
        slots = tl.arange(0, TOPK_PAD)
        lanes = tl.arange(0, BLOCK_N)
        cand = tl.where(valid, a, -1.0)
        if tl.max(tl.max(cand, 1) - tl.min(top_a, 1), 0) > 0:
            for _ in tl.static_range(TOPK):
                best = tl.max(cand, 1)
                at = tl.argmax(cand, 1)
                lowest = tl.min(top_a, 1)
                slot = tl.argmin(top_a, 1)
                hit = (slots[None, :] == slot[:, None]) & (best > lowest)[:, None]
                pick = lanes[None, :] == at[:, None]
                signed = tl.sum(tl.where(pick, w, 0.0), 1)
                top_a = tl.where(hit, best[:, None], top_a)
                top_w = tl.where(hit, signed[:, None], top_w)
                top_i = tl.where(hit, (n0 + at)[:, None], top_i)
                cand = tl.where(pick, -1.0, cand)
    return acc, rest, rest_log, first, first_value, top_a, top_w, top_i


@no_type_check  # the tests' jaxtyping hook must leave Triton's helpers alone
@triton.jit
def _store_rows(
    S: tl.constexpr, ROWS, TOP_W, TOP_A, TOP_I, h, rows, row_ok, num_heads, num_q, state,
    TOPK: tl.constexpr, TOPK_PAD: tl.constexpr,
):  # fmt: skip
    """Slot ``S``'s accumulators to ``ROWS[S, field, h, rows]`` and its top keys to
    ``TOP_*[S, h, rows, :]``."""
    acc, rest, rest_log, first, first_value, top_a, top_w, top_i = state
    plane = num_heads * num_q
    at = S * 5 * plane + h * num_q + rows
    tl.store(ROWS + at, acc, mask=row_ok)
    tl.store(ROWS + at + plane, rest, mask=row_ok)
    tl.store(ROWS + at + 2 * plane, rest_log, mask=row_ok)
    tl.store(ROWS + at + 3 * plane, first, mask=row_ok)
    tl.store(ROWS + at + 4 * plane, first_value, mask=row_ok)
    if TOPK > 0:
        slots = tl.arange(0, TOPK_PAD)
        top_at = ((S * num_heads + h) * num_q + rows)[:, None] * TOPK + slots[None, :]
        top_mask = row_ok[:, None] & (slots[None, :] < TOPK)
        tl.store(TOP_A + top_at, top_a, mask=top_mask)
        tl.store(TOP_W + top_at, top_w, mask=top_mask)
        tl.store(TOP_I + top_at, top_i, mask=top_mask)


@no_type_check  # the tests' jaxtyping hook must leave Triton's helpers alone
@triton.jit
def _tile(
    Q, K, V, BACK, LEFT, LSE, rows, cols, row_ok, col_ok, dims, dim_ok,
    start, stop, scaling, softcap, s_qt, s_kt,
    ALPHA: tl.constexpr, P: tl.constexpr, PH: tl.constexpr, SOFTCAP: tl.constexpr,
    DOT: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """α, p and p^(h) of one (queries, keys) tile, as the measures need them (zeros
    for what none needs: the compiler drops them). The pointers are the head's own: ``Q``,
    ``BACK``, ``LEFT`` and ``LSE`` of query head h, ``K`` and ``V`` of its KV head."""
    q_mask = row_ok[:, None] & dim_ok[None, :]
    kv_mask = col_ok[:, None] & dim_ok[None, :]
    q_at = rows[:, None] * s_qt + dims[None, :]
    kv_at = cols[:, None] * s_kt + dims[None, :]
    valid = (cols[None, :] >= start[:, None]) & (cols[None, :] < stop[:, None])
    zero = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    alpha, p, ph = zero, zero, zero
    if ALPHA:
        q = tl.load(Q + q_at, mask=q_mask, other=0.0)
        k = tl.load(K + kv_at, mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), DOT, INTERPRET) * scaling
        if SOFTCAP:
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * (s / softcap)) + 1.0))  # softcap·tanh
        lse = tl.load(LSE + rows, mask=row_ok, other=0.0)
        lse = tl.where(lse == float("-inf"), 0.0, lse)
        alpha = tl.where(valid, tl.exp(tl.where(valid, s, 0.0) - lse[:, None]), 0.0)
    if P or PH:
        v = tl.load(V + kv_at, mask=kv_mask, other=0.0)
        if P:
            back = tl.load(BACK + q_at, mask=q_mask, other=0.0)
            p = tl.where(valid, _dot(back, tl.trans(v), DOT, INTERPRET), 0.0)
        if PH:
            left = tl.load(LEFT + q_at, mask=q_mask, other=0.0)
            ph = tl.where(valid, _dot(left, tl.trans(v), DOT, INTERPRET), 0.0)
    return alpha, p, ph, valid


# The two kernels spell their eight slots out: a slot is code only where its M is >= 0.
@no_type_check  # jitted by build(); left alone by the tests' jaxtyping hook
def _rows(
    Q, K, V, BACK, LEFT, START, STOP, LSE, OUT_NORM, VALUE_NORM, KEY_LO, KEY_HI,
    ROWS, TOP_W, TOP_A, TOP_I,
    num_heads, num_q, num_k, dim, group, scaling, softcap, s_qh, s_qt, s_kh, s_kt,
    M0: tl.constexpr, M1: tl.constexpr, M2: tl.constexpr, M3: tl.constexpr,
    M4: tl.constexpr, M5: tl.constexpr, M6: tl.constexpr, M7: tl.constexpr,
    ALPHA: tl.constexpr, P: tl.constexpr, PH: tl.constexpr, VNORM: tl.constexpr,
    ONORM: tl.constexpr, SOFTCAP: tl.constexpr, DOT: tl.constexpr, INTERPRET: tl.constexpr,
    TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Per query: every slot's row sums, entropies' sums, key-0 entries and top keys."""
    h = tl.program_id(0).to(tl.int64)  # 64-bit offsets: H · T · d_h may pass 2^31
    tile = tl.num_programs(1) - 1 - tl.program_id(1)  # the longest tiles first
    kv = h // group
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_q
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < dim
    start = tl.load(START + rows, mask=row_ok, other=0)
    stop = tl.load(STOP + rows, mask=row_ok, other=0)
    onorm = tl.zeros((BLOCK_M,), tl.float32)
    if ONORM:
        onorm = tl.load(OUT_NORM + rows, mask=row_ok, other=0.0)
    lo = tl.load(KEY_LO + tile)
    hi = tl.load(KEY_HI + tile)
    if M0 >= 0:
        s0 = _row_state(BLOCK_M, TOPK, TOPK_PAD)
    if M1 >= 0:
        s1 = _row_state(BLOCK_M, TOPK, TOPK_PAD)
    if M2 >= 0:
        s2 = _row_state(BLOCK_M, TOPK, TOPK_PAD)
    if M3 >= 0:
        s3 = _row_state(BLOCK_M, TOPK, TOPK_PAD)
    if M4 >= 0:
        s4 = _row_state(BLOCK_M, TOPK, TOPK_PAD)
    if M5 >= 0:
        s5 = _row_state(BLOCK_M, TOPK, TOPK_PAD)
    if M6 >= 0:
        s6 = _row_state(BLOCK_M, TOPK, TOPK_PAD)
    if M7 >= 0:
        s7 = _row_state(BLOCK_M, TOPK, TOPK_PAD)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < num_k
        alpha, p, ph, valid = _tile(
            Q + h * s_qh, K + kv * s_kh, V + kv * s_kh, BACK + h * s_qh, LEFT + h * s_qh,
            LSE + h * num_q, rows, cols, row_ok, col_ok, dims, dim_ok, start, stop,
            scaling, softcap, s_qt, s_kt,
            ALPHA, P, PH, SOFTCAP, DOT, INTERPRET, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        vnorm = tl.zeros((BLOCK_N,), tl.float32)
        if VNORM:
            vnorm = tl.load(VALUE_NORM + h * num_k + cols, mask=col_ok, other=0.0)
        if M0 >= 0:
            w, a = _weight(M0, alpha, p, ph, vnorm, onorm, valid)
            s0 = _fold_rows(M0, w, a, cols, valid, n0, s0, TOPK, TOPK_PAD, BLOCK_N)
        if M1 >= 0:
            w, a = _weight(M1, alpha, p, ph, vnorm, onorm, valid)
            s1 = _fold_rows(M1, w, a, cols, valid, n0, s1, TOPK, TOPK_PAD, BLOCK_N)
        if M2 >= 0:
            w, a = _weight(M2, alpha, p, ph, vnorm, onorm, valid)
            s2 = _fold_rows(M2, w, a, cols, valid, n0, s2, TOPK, TOPK_PAD, BLOCK_N)
        if M3 >= 0:
            w, a = _weight(M3, alpha, p, ph, vnorm, onorm, valid)
            s3 = _fold_rows(M3, w, a, cols, valid, n0, s3, TOPK, TOPK_PAD, BLOCK_N)
        if M4 >= 0:
            w, a = _weight(M4, alpha, p, ph, vnorm, onorm, valid)
            s4 = _fold_rows(M4, w, a, cols, valid, n0, s4, TOPK, TOPK_PAD, BLOCK_N)
        if M5 >= 0:
            w, a = _weight(M5, alpha, p, ph, vnorm, onorm, valid)
            s5 = _fold_rows(M5, w, a, cols, valid, n0, s5, TOPK, TOPK_PAD, BLOCK_N)
        if M6 >= 0:
            w, a = _weight(M6, alpha, p, ph, vnorm, onorm, valid)
            s6 = _fold_rows(M6, w, a, cols, valid, n0, s6, TOPK, TOPK_PAD, BLOCK_N)
        if M7 >= 0:
            w, a = _weight(M7, alpha, p, ph, vnorm, onorm, valid)
            s7 = _fold_rows(M7, w, a, cols, valid, n0, s7, TOPK, TOPK_PAD, BLOCK_N)
    if M0 >= 0:
        _store_rows(
            0, ROWS, TOP_W, TOP_A, TOP_I, h, rows, row_ok, num_heads, num_q, s0, TOPK, TOPK_PAD
        )
    if M1 >= 0:
        _store_rows(
            1, ROWS, TOP_W, TOP_A, TOP_I, h, rows, row_ok, num_heads, num_q, s1, TOPK, TOPK_PAD
        )
    if M2 >= 0:
        _store_rows(
            2, ROWS, TOP_W, TOP_A, TOP_I, h, rows, row_ok, num_heads, num_q, s2, TOPK, TOPK_PAD
        )
    if M3 >= 0:
        _store_rows(
            3, ROWS, TOP_W, TOP_A, TOP_I, h, rows, row_ok, num_heads, num_q, s3, TOPK, TOPK_PAD
        )
    if M4 >= 0:
        _store_rows(
            4, ROWS, TOP_W, TOP_A, TOP_I, h, rows, row_ok, num_heads, num_q, s4, TOPK, TOPK_PAD
        )
    if M5 >= 0:
        _store_rows(
            5, ROWS, TOP_W, TOP_A, TOP_I, h, rows, row_ok, num_heads, num_q, s5, TOPK, TOPK_PAD
        )
    if M6 >= 0:
        _store_rows(
            6, ROWS, TOP_W, TOP_A, TOP_I, h, rows, row_ok, num_heads, num_q, s6, TOPK, TOPK_PAD
        )
    if M7 >= 0:
        _store_rows(
            7, ROWS, TOP_W, TOP_A, TOP_I, h, rows, row_ok, num_heads, num_q, s7, TOPK, TOPK_PAD
        )


@no_type_check  # jitted by build(); left alone by the tests' jaxtyping hook
def _cols(
    Q, K, V, BACK, LEFT, START, STOP, LSE, OUT_NORM, VALUE_NORM, QUERY_LO, QUERY_HI, COLS,
    num_heads, num_q, num_k, dim, group, scaling, softcap, s_qh, s_qt, s_kh, s_kt,
    M0: tl.constexpr, M1: tl.constexpr, M2: tl.constexpr, M3: tl.constexpr,
    M4: tl.constexpr, M5: tl.constexpr, M6: tl.constexpr, M7: tl.constexpr,
    ALPHA: tl.constexpr, P: tl.constexpr, PH: tl.constexpr, VNORM: tl.constexpr,
    ONORM: tl.constexpr, SOFTCAP: tl.constexpr, DOT: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Per key: every slot's column sums ``COLS[2S]`` and sums of magnitudes ``COLS[2S+1]``
    over the queries that see it."""
    h = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    kv = h // group
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < num_k
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < dim
    vnorm = tl.zeros((BLOCK_N,), tl.float32)
    if VNORM:
        vnorm = tl.load(VALUE_NORM + h * num_k + cols, mask=col_ok, other=0.0)
    lo = tl.load(QUERY_LO + tile)
    hi = tl.load(QUERY_HI + tile)
    zero = tl.zeros((BLOCK_N,), tl.float32)
    if M0 >= 0:
        c0 = zero, zero
    if M1 >= 0:
        c1 = zero, zero
    if M2 >= 0:
        c2 = zero, zero
    if M3 >= 0:
        c3 = zero, zero
    if M4 >= 0:
        c4 = zero, zero
    if M5 >= 0:
        c5 = zero, zero
    if M6 >= 0:
        c6 = zero, zero
    if M7 >= 0:
        c7 = zero, zero
    for n0 in range(lo, hi, BLOCK_M):
        rows = n0 + tl.arange(0, BLOCK_M)
        row_ok = rows < num_q
        start = tl.load(START + rows, mask=row_ok, other=0)
        stop = tl.load(STOP + rows, mask=row_ok, other=0)
        alpha, p, ph, valid = _tile(
            Q + h * s_qh, K + kv * s_kh, V + kv * s_kh, BACK + h * s_qh, LEFT + h * s_qh,
            LSE + h * num_q, rows, cols, row_ok, col_ok, dims, dim_ok, start, stop,
            scaling, softcap, s_qt, s_kt,
            ALPHA, P, PH, SOFTCAP, DOT, INTERPRET, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        onorm = tl.zeros((BLOCK_M,), tl.float32)
        if ONORM:
            onorm = tl.load(OUT_NORM + rows, mask=row_ok, other=0.0)
        if M0 >= 0:
            w, a = _weight(M0, alpha, p, ph, vnorm, onorm, valid)
            c0 = c0[0] + tl.sum(w, 0), c0[1] + tl.sum(a, 0)
        if M1 >= 0:
            w, a = _weight(M1, alpha, p, ph, vnorm, onorm, valid)
            c1 = c1[0] + tl.sum(w, 0), c1[1] + tl.sum(a, 0)
        if M2 >= 0:
            w, a = _weight(M2, alpha, p, ph, vnorm, onorm, valid)
            c2 = c2[0] + tl.sum(w, 0), c2[1] + tl.sum(a, 0)
        if M3 >= 0:
            w, a = _weight(M3, alpha, p, ph, vnorm, onorm, valid)
            c3 = c3[0] + tl.sum(w, 0), c3[1] + tl.sum(a, 0)
        if M4 >= 0:
            w, a = _weight(M4, alpha, p, ph, vnorm, onorm, valid)
            c4 = c4[0] + tl.sum(w, 0), c4[1] + tl.sum(a, 0)
        if M5 >= 0:
            w, a = _weight(M5, alpha, p, ph, vnorm, onorm, valid)
            c5 = c5[0] + tl.sum(w, 0), c5[1] + tl.sum(a, 0)
        if M6 >= 0:
            w, a = _weight(M6, alpha, p, ph, vnorm, onorm, valid)
            c6 = c6[0] + tl.sum(w, 0), c6[1] + tl.sum(a, 0)
        if M7 >= 0:
            w, a = _weight(M7, alpha, p, ph, vnorm, onorm, valid)
            c7 = c7[0] + tl.sum(w, 0), c7[1] + tl.sum(a, 0)
    plane = num_heads * num_k
    at = h * num_k + cols
    if M0 >= 0:
        tl.store(COLS + 0 * plane + at, c0[0], mask=col_ok)
        tl.store(COLS + 1 * plane + at, c0[1], mask=col_ok)
    if M1 >= 0:
        tl.store(COLS + 2 * plane + at, c1[0], mask=col_ok)
        tl.store(COLS + 3 * plane + at, c1[1], mask=col_ok)
    if M2 >= 0:
        tl.store(COLS + 4 * plane + at, c2[0], mask=col_ok)
        tl.store(COLS + 5 * plane + at, c2[1], mask=col_ok)
    if M3 >= 0:
        tl.store(COLS + 6 * plane + at, c3[0], mask=col_ok)
        tl.store(COLS + 7 * plane + at, c3[1], mask=col_ok)
    if M4 >= 0:
        tl.store(COLS + 8 * plane + at, c4[0], mask=col_ok)
        tl.store(COLS + 9 * plane + at, c4[1], mask=col_ok)
    if M5 >= 0:
        tl.store(COLS + 10 * plane + at, c5[0], mask=col_ok)
        tl.store(COLS + 11 * plane + at, c5[1], mask=col_ok)
    if M6 >= 0:
        tl.store(COLS + 12 * plane + at, c6[0], mask=col_ok)
        tl.store(COLS + 13 * plane + at, c6[1], mask=col_ok)
    if M7 >= 0:
        tl.store(COLS + 14 * plane + at, c7[0], mask=col_ok)
        tl.store(COLS + 15 * plane + at, c7[1], mask=col_ok)
