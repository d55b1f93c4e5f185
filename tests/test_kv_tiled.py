"""KV scoring with the tiled kernels (``kv.prefill(..., kernels="triton")``), run by
Triton's interpreter on CPU: the every-query attention sums that H2O, VATP and observed
attention read come from the kernels instead of blocks of probabilities, and equal the
plain path's; only the window's rows are computed eagerly."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from contribution_weights import kv
from contribution_weights.capture import LayerCall
from contribution_weights.measures import tiled

pytest.importorskip("triton")

EVERY_QUERY = ["h2o", "vatp", "observed_attention", "snapkv", "contribution_sinks"]


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(tiled, "TILE", 32)  # several tiles at a few dozen tokens


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gemma2"])  # GQA, window, soft-cap
def test_tiled_attention_sums_equal_the_plain_prefill(family, monkeypatch):
    model = tiny_model(family)
    model.model.config.max_position_embeddings = 512
    ids = torch.randint(0, 99, (1, 70), generator=torch.Generator().manual_seed(5))
    plain = kv.prefill(model, ids, window=8, methods=EVERY_QUERY)
    asked: list[tuple[int, slice]] = []
    real = LayerCall.probs

    def recording(self, rows, *args, **kwargs):
        asked.append((self.layer_idx, rows))
        return real(self, rows, *args, **kwargs)

    monkeypatch.setattr(LayerCall, "probs", recording)
    fast = kv.prefill(model, ids, window=8, methods=EVERY_QUERY, kernels="triton")
    assert fast.stats.keys() == plain.stats.keys() and fast.stats
    # compressed layers: the window's rows only (sliding-window layers are not compressed
    # and run as before)
    assert {(r.start, r.stop) for layer, r in asked if layer in fast.stats} == {(62, 70)}
    for layer, ref in plain.stats.items():
        got = fast.stats[layer]
        torch.testing.assert_close(got.attn_sum, ref.attn_sum, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got.window_probs, ref.window_probs, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(
            got.window_contribution, ref.window_contribution, rtol=1e-3, atol=1e-4
        )
    torch.testing.assert_close(fast.logits, plain.logits, rtol=1e-4, atol=1e-4)
    for method in ["h2o", "vatp", "observed_attention"]:
        a, b = kv.compress(fast, method, 0.5), kv.compress(plain, method, 0.5)
        same = sum(torch.equal(a.kept[i], b.kept[i]) for i in a.kept)
        assert same >= len(a.kept) - 1, method  # a near-tie may swap one entry in a layer


def test_an_unknown_kernel_is_a_clear_error():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="kernels must be 'torch' or 'triton'"):
        kv.prefill(model, torch.arange(10), kernels="cuda")
