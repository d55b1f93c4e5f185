"""The shortcuts the plain torch reductions take, each against the longer way it replaces:
products per KV head instead of values copied per query head, key norms made once per
layer, non-weight measures summed by matrix–vector products on a block the layer holds,
the entropies' sums read with the row sums, and ln α from the scores instead of a log."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import tiny_model

import contribution_weights as cw
from contribution_weights.capture import layer as capture_layer
from contribution_weights.measures import aggregates
from contribution_weights.measures.kernels import block_sums
from contribution_weights.measures.layer import grouped_dot, value_norms
from contribution_weights.measures.reductions import top_indices

IDS = torch.randint(0, 90, (128,), generator=torch.Generator().manual_seed(3))
BLOCK = 4 * 128 * 8 * 20  # 20 queries a block: the blocks narrow to their keys


def test_grouped_dot_is_the_product_with_values_copied_per_head():
    gen = torch.Generator().manual_seed(0)
    left = torch.randn(2, 6, 5, 4, generator=gen, dtype=torch.float64)
    values = torch.randn(2, 3, 7, 4, generator=gen, dtype=torch.float64)
    copied = values.repeat_interleave(2, dim=1)
    want = left @ copied.transpose(-1, -2)
    assert torch.allclose(grouped_dot(left, values), want, rtol=1e-12, atol=0)
    out = torch.empty(2, 6, 5, 7, dtype=torch.float64)
    assert grouped_dot(left, values, out=out) is out
    assert torch.allclose(out, want, rtol=1e-12, atol=0)


def test_value_norms_are_the_projected_values_norms():
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(1, 2, 9, 4, generator=gen, dtype=torch.float64)
    w_o = torch.randn(6, 10, 4, generator=gen, dtype=torch.float64)
    gram = w_o.transpose(1, 2) @ w_o
    projected = torch.einsum("bhtd,hed->bhte", values.repeat_interleave(3, dim=1), w_o)
    assert torch.allclose(value_norms(values, gram), projected.norm(dim=-1), rtol=1e-12)


@pytest.mark.parametrize("chunk_bytes", [64, 1 << 20])  # row chunks, or the block whole
def test_sums_and_a_log_a(monkeypatch, chunk_bytes):
    monkeypatch.setattr(aggregates, "LOG_CHUNK_BYTES", chunk_bytes)
    gen = torch.Generator().manual_seed(2)
    scores = torch.randn(3, 7, 11, generator=gen, dtype=torch.float64) * 4
    scores[..., 5:] = torch.finfo(torch.float64).min  # masked keys: α exactly 0
    a = scores.softmax(-1)
    total, a_log_a = aggregates.sums_and_a_log_a(a)
    want = torch.special.xlogy(a, a).sum(-1)
    assert torch.equal(total, a.sum(-1))
    assert torch.allclose(a_log_a, want, rtol=1e-12, atol=1e-15)
    assert aggregates.sums_and_a_log_a(a, totals=False)[0] is None
    lse = torch.logsumexp(scores, -1)
    total, from_scores = aggregates.sums_and_a_log_a(a, logits=(scores, lse))
    assert torch.allclose(from_scores, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
def test_non_weight_sums_equal_the_sums_of_their_maps(family):
    """cosine and projection are summed without their maps (ScaledBlock); their sums are
    those of the maps a trace derives from its stored factors."""
    lm = tiny_model(family)
    names = ["cosine", "projection"]
    tr = cw.trace(lm, IDS, measures=names, block_bytes=BLOCK)
    sums = cw.trace(lm, IDS, measures=names, block_bytes=BLOCK, maps=False)
    for name in names:
        full = tr[name].tensor()  # (L, H, T, T)
        red = sums.reductions[name]
        for got, want in (
            (red.token_sums, full.sum(-2)),
            (red.row_sum, full.sum(-1)),
            (red.first, full[..., 0]),
        ):
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())), name


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
def test_entropies_from_the_scores_match_the_log_pass(family, monkeypatch):
    """Attention's and vw's entropies, read from the scores capture keeps, equal those of a
    log pass over the block to float32 rounding, and are as close to a float64 trace."""
    lm = tiny_model(family)
    fast = cw.trace(lm, IDS, maps=False, block_bytes=BLOCK)
    exact = cw.trace(lm, IDS, maps=False, compute_dtype="float64")
    keep = capture_layer.LayerCall.probs_and_logits

    def without_scores(self, *args, **kwargs):
        return keep(self, *args, **kwargs)[0], None

    monkeypatch.setattr(capture_layer.LayerCall, "probs_and_logits", without_scores)
    logged = cw.trace(lm, IDS, maps=False, block_bytes=BLOCK)
    for name in ("attention", "vw", "vw_on"):
        for field in ("entropy", "entropy_excl_first"):
            a, b, c = (getattr(t.reductions[name], field) for t in (fast, logged, exact))
            assert torch.allclose(a, b, rtol=0, atol=2e-5), (name, field)
            err_fast = float((a.double() - c).abs().max())
            err_log = float((b.double() - c).abs().max())
            assert err_fast <= max(2 * err_log, 1e-5), (name, field, err_fast, err_log)
    # the other measures take no logits: untouched
    for name in ("contribution", "intra", "cosine"):
        assert torch.equal(fast.reductions[name].entropy, logged.reductions[name].entropy)


def test_logits_give_the_log_of_the_probabilities():
    gen = torch.Generator().manual_seed(4)
    scores = torch.randn(1, 2, 3, 9, generator=gen) * 5
    scores[..., 6:] = torch.finfo(torch.float32).min  # masked: α exactly 0
    probs = scores.softmax(-1)
    g = capture_layer.Logits(scores, probs)
    log = g.scores - g.lse[..., None]
    assert torch.allclose(log[..., :6], probs[..., :6].log(), atol=1e-5)


def test_scores_of_minus_infinity_fall_back_to_the_log_pass():
    """0 · -inf is NaN: a block whose masked scores are -inf takes the log pass instead."""
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(2, 4, 40, generator=gen) * 3
    scores[..., 30:] = -math.inf
    probs = scores.softmax(-1)
    g = capture_layer.Logits(scores[None], probs[None])
    fast = block_sums(probs, signed=False, log_terms=(g.scores[0], g.lse[0], None))
    slow = block_sums(probs, signed=False)
    assert torch.isfinite(fast.rest_log).all()
    assert torch.equal(fast.rest_log, slow.rest_log)


def test_freed_blocks_are_kept_unless_the_user_opts_out(monkeypatch):
    from contribution_weights.capture import allocator

    allocator.keep_freed_blocks.cache_clear()
    monkeypatch.setenv("CW_KEEP_FREED_MEMORY", "0")
    assert allocator.keep_freed_blocks() is False
    allocator.keep_freed_blocks.cache_clear()
    monkeypatch.delenv("CW_KEEP_FREED_MEMORY")
    import sys

    assert allocator.keep_freed_blocks() is sys.platform.startswith("linux")
    allocator.keep_freed_blocks.cache_clear()


@pytest.mark.parametrize("chunk_bytes", [3000, 1 << 30])  # chunks of queries, or the usual passes
def test_signed_blocks_are_summed_in_one_pass(monkeypatch, chunk_bytes):
    """A signed block larger than a chunk is summed by signed_block_sums (one pass of row
    chunks, |w| never whole); its sums are the passes' own, its top keys a full topk's."""
    monkeypatch.setattr(aggregates, "LOG_CHUNK_BYTES", chunk_bytes)
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(3, 13, 1100, generator=gen, dtype=torch.float64)  # 1100 keys: a short last run
    w[..., 0] += 40.0
    w[1, 2, 5] = 0.0  # 0 · ln 0 is 0
    a = w.abs()
    s = block_sums(w, signed=True, maxima=True, col_abs=True)
    torch.testing.assert_close(s.col, w.sum(-2))
    torch.testing.assert_close(s.col_abs, a.sum(-2))
    torch.testing.assert_close(s.row, w.sum(-1))
    torch.testing.assert_close(s.rest_total, a[..., 1:].sum(-1))
    torch.testing.assert_close(s.rest_log, torch.special.xlogy(a[..., 1:], a[..., 1:]).sum(-1))
    torch.testing.assert_close(s.first, a[..., 0])
    torch.testing.assert_close(s.first_value, w[..., 0])
    assert s.maxima is not None and s.maxima.shape[-1] == 35  # 34 runs of 32, then 12 keys
    torch.testing.assert_close(s.maxima[..., -1], a[..., 1088:].amax(-1))
    torch.testing.assert_close(s.maxima[..., 3], a[..., 96:128].amax(-1))
    got = top_indices(w, 8, maxima=s.maxima, signed=True)
    assert torch.equal(got, torch.topk(a, 8).indices)
