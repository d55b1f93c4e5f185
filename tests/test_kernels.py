"""Block reductions: the plain torch reference against the fused and compiled paths."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model

import contribution_weights as cw
from contribution_weights.measures import kernels as K
from contribution_weights.measures.reductions import chunked, top_indices
from contribution_weights.tracing import TraceOptions

FIELDS = ("token_sums", "first", "row_sum", "entropy", "entropy_excl_first", "top_values")


def _block(signed: bool, shape: tuple[int, int, int] = (3, 5, 70), seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.rand(shape, generator=gen, dtype=torch.float64)
    w[..., 0] += 50.0  # a sink: nearly all of each row on the first key
    w[..., 7] = 0.0  # exact zeros (0 · log 0 is 0)
    return w * torch.randn(shape, generator=gen, dtype=torch.float64).sign() if signed else w


@pytest.mark.parametrize("signed", [True, False])
def test_fused_block_sums_equal_the_reference(signed):
    w = _block(signed)
    ref = K.block_sums(w, signed=signed, maxima=True)
    fused = K.BlockSums(*K.fused_block_sums(w))
    for name in K.BlockSums._fields:
        torch.testing.assert_close(getattr(fused, name), getattr(ref, name), rtol=1e-12, atol=0)
    a = w.abs()
    torch.testing.assert_close(ref.rest_log, (a[..., 1:] * a[..., 1:].log()).nan_to_num().sum(-1))
    assert ref.maxima is not None and ref.maxima.shape[-1] == 3  # 70 keys: chunks of 32, 32, 6
    torch.testing.assert_close(ref.maxima[..., 2], a[..., 64:].amax(-1))


@pytest.mark.parametrize("t", [1024, 1100, 1279])  # whole chunks, and a shorter last one
def test_chunked_top_keys_equal_a_full_topk(t):
    gen = torch.Generator().manual_seed(t)
    a = torch.rand(2, 3, t, generator=gen)
    a[0, 0, -1] = 2.0  # the largest entry in the last (short) chunk
    assert chunked(t, 8)
    got = top_indices(a, 8)
    want = torch.topk(a, 8, dim=-1).indices
    assert torch.equal(got, want)


def _traces(monkeypatch=None, **kw):
    lm = tiny_model("llama")
    lm.model.config.max_position_embeddings = 512  # rotary: any length works
    ids = torch.randint(0, 99, (300,), generator=torch.Generator().manual_seed(1))
    common = dict(maps=False, top_k=2, block_bytes=40_000, progress=False, **kw)
    return (
        cw.trace(lm, ids, kernels="torch", **common),
        cw.trace(lm, ids, kernels="compiled", **common),
    )


def assert_sums_close(plain, other, atol=1e-5):
    """Every reduction of ``other`` equals the plain trace's (top keys aside)."""
    for name, r in plain.reductions.items():
        c = other.reductions[name]
        for field in FIELDS:
            x, y = getattr(c, field), getattr(r, field)
            if x is not None or y is not None:
                torch.testing.assert_close(x, y, rtol=1e-4, atol=atol, msg=f"{name}.{field}")


def _assert_same(plain, fused):
    assert_sums_close(plain, fused)
    for name, r in plain.reductions.items():
        if r.top_keys is not None:
            assert torch.equal(fused.reductions[name].top_keys, r.top_keys), name


@pytest.mark.parametrize("measures", ["all", "contribution,ihc,vw_on"])
def test_one_pass_over_the_factors_equals_the_measure_by_measure_path(monkeypatch, measures):
    """The recorder's fused path (every measure's sums from α, p, č by the recipes; top keys
    from the chunks' maxima) run eagerly, so the test needs no compiler: the same
    reductions as the plain path, top keys included, over 300 tokens in many blocks (the
    early ones too short for the chunked search, later ones with a partial last chunk)."""
    monkeypatch.setattr(K, "_FUSED", {})
    monkeypatch.setattr(
        "contribution_weights.tracing.recorder.compiled_measure_sums", K.fused_measure_sums
    )
    plain, fused = _traces(measures=measures)
    _assert_same(plain, fused)


def test_a_zero_output_row_leaves_the_base_measures_top_keys_alone(monkeypatch):
    """vw_on = vw / ‖o_i‖ shares vw's top keys. Where o_i = 0 a vw_on row is all zero while
    vw's is not: the fused path must keep vw's keys there (not mark them empty), as the
    plain path does. Here o_i is zeroed for the first query of every block."""
    from contribution_weights.measures import layer as M

    whole = M.LayerVectors.__dict__["output"].func

    def first_row_zero(self):
        out = whole(self).clone()
        out[:, 0] = 0
        return out

    monkeypatch.setattr(M.LayerTensors, "output", property(first_row_zero))
    monkeypatch.setattr(K, "_FUSED", {})
    monkeypatch.setattr(
        "contribution_weights.tracing.recorder.compiled_measure_sums", K.fused_measure_sums
    )
    plain, fused = _traces(measures="vw,vw_on,contribution,ihc")
    _assert_same(plain, fused)
    assert bool((plain.reductions["vw_on"].row_sum == 0).any())  # the zero rows are there


def test_compiled_kernels_give_the_plain_reductions(tmp_path):
    """Really compiled (inductor), in a fresh interpreter: the tests' shape checks (the
    jaxtyping import hook) wrap the maths in functions that torch.compile cannot trace, so
    here the compile would fail and fall back. A fallback fails this test (its warning is
    an error there)."""
    pytest.importorskip("torch._inductor")
    script = tmp_path / "compiled.py"
    script.write_text(
        "import sys, warnings\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "warnings.simplefilter('error', RuntimeWarning)\n"
        "import test_kernels as t\n"
        "t._assert_same(*t._traces(measures='contribution,cosine'))\n"
        "print('same')\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ind")}
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600
    )
    assert run.returncode == 0 and run.stdout.strip() == "same", run.stderr[-3000:]


def test_a_failing_compile_warns_once_and_falls_back(monkeypatch):
    """torch.compile is lazy: the compiled function fails when first called."""

    def fails_when_called(*args, **kwargs):
        def call(*tensors):
            raise RuntimeError("no C++ compiler")

        return call

    monkeypatch.setattr(
        "contribution_weights.tracing.recorder.compiled_measure_sums", fails_when_called
    )
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler.*kernels='torch'") as seen:
        plain, fell_back = _traces(measures="attention,contribution")
    assert len([w for w in seen if issubclass(w.category, RuntimeWarning)]) == 1
    _assert_same(plain, fell_back)


def test_kernel_choice(monkeypatch):
    assert not K.Kernels("auto", 100_000, "cpu").compiled  # measured slower on CPUs
    assert not K.Kernels("auto", 100_000, "cuda").compiled  # not measured there yet
    monkeypatch.setattr(K, "COMPILE_ON", frozenset({"cuda"}))
    assert not K.Kernels("auto", 100, "cuda").compiled
    assert K.Kernels("auto", K.COMPILE_FROM_TOKENS, "cuda").compiled
    assert K.Kernels("compiled").compiled and not K.Kernels("torch").compiled
    with pytest.raises(ValueError, match="kernels='fast': choose one of auto, torch, compiled"):
        K.Kernels("fast")
    with pytest.raises(ValueError, match="choose one of"):
        TraceOptions.of(None, {"kernels": "fast"})
