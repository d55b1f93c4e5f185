"""Triton kernels of the tiled reductions (see :mod:`.tiled`, which launches them).

Imported only by :func:`.tiled.kernels`, which builds them compiled (GPUs) or for
Triton's interpreter (CPU tensors: how the tests run them; the interpreter must be chosen
before triton is first imported, as its own library functions are built then). Every
kernel works on one head and a tile of queries or keys at a time and never holds more
than a ``BLOCK_M × BLOCK_N`` tile of any map:

* :func:`forward`: FlashAttention's online softmax, giving each query's log-sum-exp and
  head state ``z_i = Σ_j α_ij v_j`` in float32;
* :func:`reduce`: one measure, recomputed tile by tile from ``q, k, v`` and the
  per-query vectors (log-sum-exp, ``W_Oᵀ o_i / ‖o_i‖²``, ...), folded either along the
  keys (``AXIS = 0``: row sums, entropies' sums, the key-0 entry, the top keys) or along
  the queries (``AXIS = 1``: column sums, of the values and of their magnitudes). Two
  launches instead of atomics: deterministic sums, in the same order on every run.

Measures by number (``MEASURE``): 0 attention α, 1 contribution α·p, 2 intra α·p^(h),
3 projection p, 4 cosine p·‖o_i‖/‖ṽ_j‖, 5 vw α·‖ṽ_j‖, 6 vw_on α·‖ṽ_j‖/‖o_i‖,
7 ihc |α·p|,
where ``p_ij = ⟨W_Oᵀ o_i/‖o_i‖², v_j⟩`` and ``p^(h)_ij = ⟨Gram_h z_i/‖o_i^(h)‖², v_j⟩``.
"""

# mypy: ignore-errors
# ruff: noqa: SIM108  (an if on a constexpr is resolved when Triton compiles)

from __future__ import annotations

from types import SimpleNamespace

import triton
import triton.language as tl


def build() -> SimpleNamespace:
    """The kernels: compiled by Triton, or run by its interpreter where ``TRITON_INTERPRET``
    was set when triton was first imported (:func:`.tiled.kernels` sees to it)."""
    return SimpleNamespace(forward=triton.jit(_forward), reduce=triton.jit(_reduce))


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


def _reduce(
    Q, K, V, START, STOP, LSE, BACK, LEFT, OUT_NORM, VALUE_NORM, SPAN_LO, SPAN_HI,
    SUM, SUM_ABS, REST, REST_LOG, FIRST, FIRST_VALUE, TOP_A, TOP_W, TOP_I,
    num_q, num_k, dim, group, scaling, softcap,
    s_qh, s_qt, s_kh, s_kt,
    MEASURE: tl.constexpr, AXIS: tl.constexpr, SIGNED: tl.constexpr, SOFTCAP: tl.constexpr,
    TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0).to(tl.int64)
    if AXIS == 0:  # as in forward: the longest query tiles first
        tile = tl.num_programs(1) - 1 - tl.program_id(1)
    else:
        tile = tl.program_id(1)
    kv = h // group
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < dim
    lo = tl.load(SPAN_LO + tile)
    hi = tl.load(SPAN_HI + tile)
    if AXIS == 0:  # a tile of queries; the loop walks its keys
        acc = tl.zeros((BLOCK_M,), tl.float32)
        rest = tl.zeros((BLOCK_M,), tl.float32)
        rest_log = tl.zeros((BLOCK_M,), tl.float32)
        first = tl.zeros((BLOCK_M,), tl.float32)
        first_value = tl.zeros((BLOCK_M,), tl.float32)
        slots = tl.arange(0, TOPK_PAD)
        # padded slots hold +inf: never the smallest, so never replaced
        top_a = tl.where(slots[None, :] < TOPK, -1.0, float("inf")) + tl.zeros(
            (BLOCK_M, TOPK_PAD), tl.float32
        )
        top_w = tl.zeros((BLOCK_M, TOPK_PAD), tl.float32)
        top_i = tl.zeros((BLOCK_M, TOPK_PAD), tl.int32)
        step = BLOCK_N
    else:  # a tile of keys; the loop walks the queries that see them
        acc = tl.zeros((BLOCK_N,), tl.float32)
        acc_abs = tl.zeros((BLOCK_N,), tl.float32)
        step = BLOCK_M
    for n0 in range(lo, hi, step):
        if AXIS == 0:
            rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = n0 + tl.arange(0, BLOCK_N)
        else:
            rows = n0 + tl.arange(0, BLOCK_M)
            cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < num_q
        col_ok = cols < num_k
        q_mask = row_ok[:, None] & dim_ok[None, :]
        kv_mask = col_ok[:, None] & dim_ok[None, :]
        q_at = rows[:, None] * s_qt + dims[None, :]
        kv_at = kv * s_kh + cols[:, None] * s_kt + dims[None, :]
        v = tl.load(V + kv_at, mask=kv_mask, other=0.0)
        start = tl.load(START + rows, mask=row_ok, other=0)
        stop = tl.load(STOP + rows, mask=row_ok, other=0)
        valid = (cols[None, :] >= start[:, None]) & (cols[None, :] < stop[:, None])
        if MEASURE != 3 and MEASURE != 4:  # α
            q = tl.load(Q + h * s_qh + q_at, mask=q_mask, other=0.0)
            k = tl.load(K + kv_at, mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scaling
            if SOFTCAP:
                s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * (s / softcap)) + 1.0))
            lse = tl.load(LSE + h * num_q + rows, mask=row_ok, other=0.0)
            lse = tl.where(lse == float("-inf"), 0.0, lse)
            alpha = tl.where(valid, tl.exp(tl.where(valid, s, 0.0) - lse[:, None]), 0.0)
        if MEASURE == 1 or MEASURE == 3 or MEASURE == 4 or MEASURE == 7:  # p
            back = tl.load(BACK + h * s_qh + q_at, mask=q_mask, other=0.0)
            p = tl.where(valid, tl.dot(back, tl.trans(v), input_precision="ieee"), 0.0)
        if MEASURE == 4 or MEASURE == 5 or MEASURE == 6:  # ‖ṽ_j‖
            vnorm = tl.load(VALUE_NORM + h * num_k + cols, mask=col_ok, other=0.0)
        if MEASURE == 0:
            w = alpha
        elif MEASURE == 1:
            w = alpha * p
        elif MEASURE == 2:
            left = tl.load(LEFT + h * s_qh + q_at, mask=q_mask, other=0.0)
            w = alpha * tl.where(valid, tl.dot(left, tl.trans(v), input_precision="ieee"), 0.0)
        elif MEASURE == 3:
            w = p
        elif MEASURE == 4:
            onorm = tl.load(OUT_NORM + rows, mask=row_ok, other=0.0)
            inv_v = tl.where(vnorm > 0, 1.0 / tl.where(vnorm > 0, vnorm, 1.0), 0.0)
            w = tl.where(valid, p * onorm[:, None] * inv_v[None, :], 0.0)
        elif MEASURE == 5:
            w = alpha * vnorm[None, :]
        elif MEASURE == 6:
            onorm = tl.load(OUT_NORM + rows, mask=row_ok, other=0.0)
            inv_o = tl.where(onorm > 0, 1.0 / tl.where(onorm > 0, onorm, 1.0), 0.0)
            w = alpha * vnorm[None, :] * inv_o[:, None]
        else:
            w = tl.abs(alpha * p)
        if SIGNED:
            a = tl.abs(w)
        else:
            a = w
        if AXIS == 1:
            acc += tl.sum(w, 0)
            acc_abs += tl.sum(a, 0)
        else:
            acc += tl.sum(w, 1)
            is_first = cols[None, :] == 0
            later = tl.where(is_first, 0.0, a)
            rest += tl.sum(later, 1)
            rest_log += tl.sum(
                tl.where(later > 0, later * tl.log(tl.where(later > 0, later, 1.0)), 0.0), 1
            )
            first += tl.sum(tl.where(is_first, a, 0.0), 1)
            first_value += tl.sum(tl.where(is_first, w, 0.0), 1)
            if TOPK > 0:
                # the TOPK largest a of the tile enter the kept set where they beat its
                # smallest member: TOPK rounds of (max, argmax), each masking its pick;
                # skipped (one scalar test) when no row's best beats its kept set
                cand = tl.where(valid, a, -1.0)
                lanes = tl.arange(0, BLOCK_N)
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
    if AXIS == 1:
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < num_k
        tl.store(SUM + h * num_k + cols, acc, mask=col_ok)
        tl.store(SUM_ABS + h * num_k + cols, acc_abs, mask=col_ok)
    else:
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < num_q
        at = h * num_q + rows
        tl.store(SUM + at, acc, mask=row_ok)
        tl.store(REST + at, rest, mask=row_ok)
        tl.store(REST_LOG + at, rest_log, mask=row_ok)
        tl.store(FIRST + at, first, mask=row_ok)
        tl.store(FIRST_VALUE + at, first_value, mask=row_ok)
        if TOPK > 0:
            top_at = at[:, None] * TOPK + slots[None, :]
            top_mask = row_ok[:, None] & (slots[None, :] < TOPK)
            tl.store(TOP_A + top_at, top_a, mask=top_mask)
            tl.store(TOP_W + top_at, top_w, mask=top_mask)
            tl.store(TOP_I + top_at, top_i, mask=top_mask)
