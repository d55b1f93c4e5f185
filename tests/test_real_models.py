"""The exactness and sum checks on real models (slow: they load SmolLM2 / Gemma 3).

The reference side is the same as for the tiny models (:mod:`reference`): the model's own
eager attention and plain hooks, every ṽ materialised, float64 maths.
"""

from __future__ import annotations

import os

import pytest
import torch
from reference import allowed, eager_run, window

import contribution_weights as cw
from contribution_weights.capture import capturing
from contribution_weights.inputs import encode
from contribution_weights.loading import cache_dir

pytestmark = pytest.mark.slow

TEXT = (
    "The Eiffel Tower was built for the 1889 World's Fair in Paris. At first many artists "
    "criticised its design, but it soon became the symbol of the city."
)
ALL = ["attention", "contribution", "intra", "relative_norm", "cosine", "vw", "vw_on"]
ALL += ["distance", "ihc"]


def _rel_check(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str) -> None:
    """|a − e| ≤ rtol·(|e| + 10⁻³·max|e|): relative, with a floor for entries that cancel."""
    scale = expected.abs().max().item()
    err = (actual.double() - expected).abs()
    assert torch.isfinite(actual).all(), what
    ok = err <= rtol * (expected.abs() + 1e-3 * scale)
    assert ok.all(), f"{what}: max error {err.max().item():.3g}, scale {scale:.3g}"


def check_exact(loaded: cw.LoadedModel, text: str, layers: list[int]) -> None:
    """Capture logits == eager logits, and every measure == the float64 reference."""
    ids = encode(loaded, text, None, False)
    run = eager_run(loaded.model, ids[None])
    with torch.no_grad(), capturing(loaded.model, kernel="eager"):
        logits = loaded.model(input_ids=ids[None], use_cache=False).logits
    assert torch.equal(logits, run.logits)
    tr = cw.trace(
        loaded, ids, measures=ALL, layers=layers, compute_dtype="float64", exact_inputs=True
    )
    for pos, layer in enumerate(tr.layers):
        ref = run.layer(layer, 0, allowed(len(ids), window(loaded.model, layer)))
        hooked = run.outputs[layer][0].double()  # Σ_h o^(h) + b = the output projection's output
        atol = 1e-5 * hooked.abs().max().item()
        torch.testing.assert_close(ref["output"], hooked, rtol=1e-4, atol=atol)
        for name in ALL:
            _rel_check(tr[name][pos], ref[name], 1e-5, f"{name} layer {layer}")
        torch.testing.assert_close(tr.bias_share[pos], ref["bias_share"], rtol=0, atol=1e-8)
    # float32 (the default): within 1e-4 of each measure's scale (measured: ≤ 1e-5 on SmolLM2)
    tr32 = cw.trace(loaded, ids, measures=ALL, layers=layers, exact_inputs=True)
    full = {name: tr[name].tensor() for name in ALL}
    for name in ALL:
        scale = full[name].abs().amax(dim=(1, 2, 3), keepdim=True)
        assert ((tr32[name].tensor().double() - full[name]).abs() <= 1e-4 * scale).all(), name
    a, c = full["attention"], full["contribution"]
    torch.testing.assert_close(a.sum(-1), torch.ones_like(a.sum(-1)), rtol=0, atol=1e-5)
    want = a * full["relative_norm"] * full["cosine"]
    torch.testing.assert_close(c, want, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(c.sum(dim=(1, 3)), 1 - tr.bias_share, rtol=0, atol=1e-9)
    intra_sum = full["intra"].sum(-1)
    torch.testing.assert_close(intra_sum, torch.ones_like(intra_sum), rtol=0, atol=1e-9)
    d_sum = full["distance"].sum(dim=(1, 3))
    torch.testing.assert_close(d_sum, torch.ones_like(d_sum), rtol=0, atol=1e-9)
    assert not tr.degenerate.any()


def test_smollm2_exact(smollm2):
    assert 30 <= len(encode(smollm2, TEXT, None, False)) <= 50
    check_exact(smollm2, TEXT, layers=[0, 14, 29])


def test_smollm2_first_token_weight(smollm2):
    tr = cw.trace(smollm2, TEXT, measures=["attention", "vw", "contribution"])
    assert tr["attention"].dtype == torch.float32 and tr["attention"].shape[:2] == (30, 9)
    first = {m: tr.first_token_weight(m).mean().item() for m in ("attention", "contribution")}
    assert first["attention"] > first["contribution"] + 0.1, first
    summary = tr.summary()
    assert summary.loc["attention", "first_token_weight"] == pytest.approx(first["attention"])


def _gemma_cached() -> bool:
    """Whether Gemma 3 270M was dequantised already (then it loads in seconds)."""
    return any((cache_dir() / "dequantised").glob("gemma-3-270m-q4_k_m-*/COMPLETE"))


@pytest.mark.skipif(
    not (os.environ.get("CW_TEST_GEMMA") == "1" or _gemma_cached()),
    reason="Gemma 3 270M is not dequantised yet (first load ~70 s); set CW_TEST_GEMMA=1 to run",
)
def test_gemma3_270m_exact():
    loaded = cw.load_model("gemma3-270m")
    assert loaded.config.model_type in ("gemma3_text", "gemma3")
    check_exact(loaded, "Paris is the capital of France.", layers=[0, 5, 17])
