"""The tiled Triton kernels (``kernels="triton"``) against the plain block reductions.

Run by Triton's interpreter on CPU tensors, as CI runs them (no GPU there): the same
kernels a GPU compiles, executed tile by tile with numpy. The families cover GQA, a
sliding window (Mistral, Gemma 3), attention soft-capping (Gemma 2) and biases (Qwen 2).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_kernels import assert_sums_close
from tiny_models import FAMILIES, tiny_model

import contribution_weights as cw
from contribution_weights.inputs import InputError
from contribution_weights.measures import tiled

pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """Tiles of 32: several tiles at a few dozen tokens, which the interpreter runs in
    seconds."""
    monkeypatch.setattr(tiled, "TILE", 32)


def _pair(family: str, tokens: int, measures: str = "all", top_k: int = 3):
    lm = tiny_model(family)
    lm.model.config.max_position_embeddings = 512
    ids = torch.randint(0, 99, (tokens,), generator=torch.Generator().manual_seed(2))
    common = dict(maps=False, top_k=top_k, measures=measures, progress=False)
    return cw.trace(lm, ids, kernels="torch", **common), cw.trace(
        lm, ids, kernels="triton", **common
    )


def _assert_same(plain, tiled):
    assert_sums_close(plain, tiled, atol=2e-5)
    for name, r in plain.reductions.items():
        c = tiled.reductions[name]
        if r.top_keys is not None:
            # the same keys wherever the plain path ranks a key of nonzero weight, but for
            # exact ties (two keys of one weight: either may be kept), which the values
            # above already checked
            kept = r.top_values != 0
            differ = (c.top_keys != r.top_keys) & kept
            tied = (c.top_values - r.top_values).abs() <= 1e-6
            assert bool((tied | ~differ).all()), name
            assert int(differ.sum()) <= 0.01 * int(kept.sum()), name
    for name, v in plain.vectors.items():
        got = tiled.vectors[name]
        if v.dtype == torch.bool or not v.is_floating_point():
            assert torch.equal(got, v), name
        else:
            torch.testing.assert_close(got, v, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize(
    ("family", "measures"),
    [
        ("llama", "all"),  # GQA; every measure of "all"
        ("mistral", "attention,contribution"),  # a sliding window
        ("gemma2", "attention,cosine"),  # soft-capped scores
        ("gemma3_text", "intra,vw_on"),  # sliding and full layers
        ("qwen2", "projection,vw"),  # biases
    ],
)
def test_tiled_kernels_give_the_plain_reductions(family, measures):
    """Over 40 tokens: two tiles of queries and of keys, the second partial. (The
    interpreter is slow: every measure on one family, the families' features on a few.)"""
    _assert_same(*_pair(family, 40, measures))


#: the largest error each product precision may make, relative to the largest magnitude of
#: the reduction, against a float64 trace (docs/long-contexts.md gives the measured one:
#: benchmarks/kernel_precision.py on real weights)
BUDGET = {"ieee": 2e-5, "tf32": 5e-3, "bf16": 4e-2}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_precision_within_its_error_budget_on_every_family(family):
    """ieee, tf32 and bf16 products against the plain path in float64, over 40 tokens (two
    tiles, the second partial): each within its budget, and the rounding of the operands
    really used (tf32 and bf16 err more than ieee)."""
    lm = tiny_model(family)
    lm.model.config.max_position_embeddings = 512
    ids = torch.randint(0, 99, (40,), generator=torch.Generator().manual_seed(3))
    common = dict(maps=False, top_k=3, measures="attention,contribution,intra", progress=False)
    reference = cw.trace(lm, ids, kernels="torch", compute_dtype="float64", **common)
    worst = {}
    for precision, budget in BUDGET.items():
        got = cw.trace(lm, ids, kernels="triton", kernel_precision=precision, **common)
        assert got.meta["kernel_precision"] == precision
        worst[precision] = 0.0
        for name, r in reference.reductions.items():
            for field in ("token_sums", "row_sum", "first", "entropy", "top_values"):
                x, y = getattr(got.reductions[name], field), getattr(r, field)
                if field == "top_values":  # ranked by magnitude
                    x, y = x.abs(), y.abs()
                rel = float((x.double() - y).abs().max() / y.abs().max().clamp_min(1e-30))
                assert rel <= budget, f"{precision} {name}.{field}: {rel:.1e} > {budget:.0e}"
                worst[precision] = max(worst[precision], rel)
    assert worst["ieee"] < worst["tf32"] < worst["bf16"], worst


def test_a_precision_the_kernels_do_not_take_is_refused():
    lm = tiny_model("llama")
    with pytest.raises(ValueError, match="kernels='triton'"):
        cw.trace(lm, "a b c", kernels="torch", kernel_precision="bf16", progress=False)
    with pytest.raises(ValueError, match="ieee, tf32, bf16"):
        cw.trace(lm, "a b c", kernels="triton", kernel_precision="fp8", progress=False)


def test_tiled_kernels_with_the_faithfulness_measure_and_no_top_keys():
    _assert_same(*_pair("llama", 20, measures="ihc,vw_on,relative_norm", top_k=0))


def test_head_states_and_log_sum_exp_equal_the_explicit_softmax():
    """Step 1 (the online softmax) on its own: GQA 4:2, a sliding window of 9 keys,
    soft-capped scores; z_i = Σ_j α_ij v_j is what the layer returns to the model."""
    gen = torch.Generator().manual_seed(0)
    h, g, t, dh, d = 4, 2, 45, 8, 16
    q, k, v = (torch.randn(n, t, dh, generator=gen) for n in (h, g, g))
    w_o = torch.randn(h, d, dh, generator=gen)
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    valid = (j <= i) & (j > i - 9)
    layer = tiled.TiledLayer(
        q, k, v, valid.int().argmax(1), torch.arange(t) + 1, 0.3, 2.0, w_o, None,
        w_o.transpose(1, 2) @ w_o,
    )  # fmt: skip
    scores = 2.0 * torch.tanh(q @ k.repeat_interleave(2, 0).transpose(1, 2) * 0.3 / 2.0)
    scores = scores.masked_fill(~valid, float("-inf"))
    torch.testing.assert_close(layer.lse, scores.logsumexp(-1), rtol=1e-5, atol=1e-5)
    z = scores.softmax(-1) @ v.repeat_interleave(2, 0)
    torch.testing.assert_close(layer.z, z, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (dict(maps=True), "maps=False"),
        (dict(maps=False, measures="distance"), "distance"),
        (dict(maps=False, compute_dtype="float64"), "float32"),
    ],
)
def test_options_the_tiled_kernels_cannot_serve_are_refused(options, says):
    lm = tiny_model("llama")
    with pytest.raises(InputError, match=says):
        cw.trace(lm, "a b c", kernels="triton", progress=False, **options)


def test_the_default_tiles_against_the_plain_path(monkeypatch):
    """Tiles of 64 (the default; the other tests use 32 for speed), 70 tokens."""
    monkeypatch.setattr(tiled, "TILE", 64)
    _assert_same(*_pair("llama", 70, measures="contribution", top_k=2))


def test_tile_sizes_triton_cannot_use_are_refused():
    q = torch.zeros(2, 8, 8)
    with pytest.raises(ValueError, match="powers of two"):
        tiled.TiledLayer(
            q, q, q, torch.zeros(8), torch.ones(8), 1.0, None, torch.zeros(2, 4, 8), None,
            torch.zeros(2, 8, 8), block_m=24,
        )  # fmt: skip


COMPILE = """
from contribution_weights.measures import triton_kernels as tk
from contribution_weights.measures.tiled import compile_offline as build, slot_flags

kernels = tk.build()
ALL = [0, 1, 2, 4, 5, 6]  # the default measures' kernel numbers
for d, tile in ((128, 32), (64, 64)):  # the tiles measures/tiled.py picks for those heads
    tiles = dict(BLOCK_M=tile, BLOCK_N=tile, BLOCK_D=d)
    build(kernels.forward, dict(SOFTCAP=d == 128, **tiles))
    for numbers, top, dot in ((ALL, 8, 0), ([1, 7, 3], 0, 1), (ALL, 5, 2)):
        flags = dict(
            **slot_flags(numbers, tk.SLOTS), SOFTCAP=dot == 1, DOT=dot, INTERPRET=False, **tiles
        )
        pad = 1 << max(0, top - 1).bit_length() if top else 1
        build(kernels.rows, dict(TOPK=top, TOPK_PAD=pad, **flags))
        build(kernels.cols, flags)
print("compiled")
"""


def test_the_kernels_compile_for_a_gpu_without_one(tmp_path):
    """Triton compiles for an H100/H200 (sm_90) with no GPU present: its front end, the
    NVIDIA backend and the ptxas it ships. The interpreter never compiles, so this is what
    catches code it accepts and a GPU would not (a fresh process without TRITON_INTERPRET,
    the tiles and head sizes the launcher uses, both kernels of the fused pair, with and
    without top keys, in each precision)."""
    script = tmp_path / "compile.py"
    script.write_text(COMPILE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900
    )
    assert run.returncode == 0 and run.stdout.strip() == "compiled", run.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_on_a_gpu(tmp_path):
    """Compiled by Triton for the GPU (no interpreter: a fresh process without
    TRITON_INTERPRET), against the plain path."""
    script = tmp_path / "gpu.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import torch, test_tiled as t\n"
        "from tiny_models import tiny_model\n"
        "import contribution_weights as cw\n"
        "lm = tiny_model('llama')\n"
        "lm.model.to('cuda')\n"
        "ids = torch.randint(0, 99, (120,), generator=torch.Generator().manual_seed(2))\n"
        "kw = dict(maps=False, top_k=3, progress=False)\n"
        "t._assert_same(cw.trace(lm, ids, kernels='torch', **kw),\n"
        "               cw.trace(lm, ids, kernels='triton', **kw))\n"
        "print('same')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900
    )
    assert run.returncode == 0 and run.stdout.strip().endswith("same"), run.stderr[-3000:]
