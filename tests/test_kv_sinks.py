"""benchmarks/kv_sinks.py: one item's NLLs with token 0 kept, evicted and zeroed, against
the model's own forward with token 0 masked out, and the paired differences."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from benchmark_scripts import load_benchmark
from tiny_models import tiny_model

from contribution_weights.kv.evaluate import continuation_nll

C, K = 20, 6


@pytest.fixture(scope="module")
def sinks() -> Any:
    return load_benchmark("kv_sinks")


def _masked_nll(model: Any, ids: torch.Tensor, masked: bool) -> float:
    """The continuation's NLL from one forward over the whole item, token 0 hidden from the
    continuation's queries by the attention mask (a 4D mask: the prefill still sees it)."""
    t = ids.shape[1]
    allowed = torch.ones(t, t, dtype=torch.bool).tril()
    if masked:
        allowed[C:, 0] = False
    mask = torch.zeros(1, 1, t, t, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    with torch.no_grad():
        logits = model.model(input_ids=ids[:, :-1], attention_mask=mask[..., :-1, :-1]).logits
    return continuation_nll(logits[:, C:], ids[:, C + 1 :])  # as item_row: fed[1:] from fed[:-1]


def test_one_item_against_the_model_with_token_0_masked(sinks: Any, float64_softmax: Any) -> None:
    model = tiny_model("llama", dtype=torch.float64)
    ids = torch.randint(3, 99, (1, C + K + 1), generator=torch.Generator().manual_seed(2))
    row = sinks.item_row(model, ids, C, K)
    assert row["nll_full"] == pytest.approx(_masked_nll(model, ids, False), abs=1e-9)
    assert row["nll_full_capture"] == pytest.approx(row["nll_full"], abs=1e-9)
    # evicting token 0 from every layer's cache = the continuation not seeing it, softmax
    # renormalised over the rest
    assert row["nll_evicted"] == pytest.approx(_masked_nll(model, ids, True), abs=1e-9)
    assert abs(row["nll_evicted"] - row["nll_full"]) > 1e-6  # token 0 mattered (1.4e-5 here)
    # zeroing its column without renormalising is another intervention
    assert abs(row["nll_zeroed"] - row["nll_evicted"]) > 1e-6
    assert 0 < row["alpha_share_token0"] < 1 and 0 < row["contribution_share_token0"] < 1


def test_paired_differences_are_over_the_same_items(sinks: Any) -> None:
    rows = [
        {"nll_full": 1.0, "nll_evicted": 1.5, "nll_zeroed": 1.1},
        {"nll_full": 2.0, "nll_evicted": 2.7, "nll_zeroed": 2.3},
        {"nll_full": 3.0, "nll_evicted": 3.4, "nll_zeroed": 3.2},
    ]
    out = sinks._paired(rows)
    d = np.array([0.5, 0.7, 0.4])
    assert out["evicted_minus_kept"]["mean"] == pytest.approx(d.mean())
    assert out["evicted_minus_kept"]["se"] == pytest.approx(d.std(ddof=1) / np.sqrt(3))
    assert out["evicted_minus_zeroed"]["mean"] == pytest.approx(np.mean([0.4, 0.4, 0.2]))
    assert all(e["p_holm"] >= e["p"] for e in out.values())
