"""benchmarks/kv_eviction_geometry.py: the truths it ranks predictors against are what an
explicit eviction does, and one item runs end to end on a tiny model."""

from __future__ import annotations

import argparse
import copy
from typing import Any

import numpy as np
import pytest
import torch
from benchmark_scripts import load_benchmark
from scipy.stats import spearmanr
from tiny_models import tiny_model

import contribution_weights as cw
from contribution_weights.capture import capturing

C, WINDOW, K = 24, 6, 5  # prefill, observation window, continuation


@pytest.fixture(scope="module")
def geometry() -> Any:
    return load_benchmark("kv_eviction_geometry")


def _ids(length: int = C + K + 1) -> torch.Tensor:
    return torch.randint(3, 99, (length,), generator=torch.Generator().manual_seed(1))


def _continue(net: Any, cache: Any, fed: torch.Tensor, layer: int) -> tuple[Any, Any]:
    """The inputs and outputs of ``layer``'s output projection on the continuation."""
    seen: dict[str, torch.Tensor] = {}
    o_proj = net.model.layers[layer].self_attn.o_proj
    handle = o_proj.register_forward_hook(
        lambda mod, args, out: seen.update(z=args[0].detach(), o=out.detach())
    )
    pos = torch.arange(C, C + K)[None]
    try:
        with torch.no_grad():
            net(input_ids=fed, position_ids=pos, **{cw.kv.cache_keyword(net): cache})
    finally:
        handle.remove()
    return seen["z"][0], seen["o"][0]  # (K, H·d_h), (K, d)


def test_future_truths_are_what_an_explicit_eviction_changes(
    geometry: Any, float64_softmax: Any
) -> None:
    model = tiny_model("llama", dtype=torch.float64)  # GQA 4:2, biases on o_proj too
    net, ids = model.model, _ids()
    with torch.no_grad():
        out = net(input_ids=ids[None, :C], use_cache=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    layers = set(range(model.num_layers))
    future = geometry.FutureEffects(layers, C, WINDOW, sample=False, cross={})
    pos = torch.arange(C, C + K)[None]
    fed = ids[None, C : C + K]
    with torch.no_grad(), capturing(net, observers=[future]):
        net(input_ids=fed, position_ids=pos, **{cw.kv.cache_keyword(net): copy.deepcopy(cache)})
    n = C - WINDOW
    for layer in sorted(layers):
        assert future.out[layer]["truth"].shape == (4, n)
        assert future.out[layer]["group_truth"].shape == (2, n)
    # the eviction, explicitly: key j leaves every layer's cache (the cache's layers must
    # stay as long as each other), and layer 0, whose inputs no eviction changes, is compared
    layer, res = 0, future.out[0]
    attn = net.model.layers[layer].self_attn
    w_o = attn.o_proj.weight.detach().reshape(attn.o_proj.weight.shape[0], 4, -1)  # (d, H, d_h)
    z, o = _continue(net, copy.deepcopy(cache), fed, layer)
    for j in (0, 1, 7, n - 1):
        evicted = copy.deepcopy(cache)
        for lay in evicted.layers:
            lay.keys = torch.cat([lay.keys[:, :, :j], lay.keys[:, :, j + 1 :]], 2)
            lay.values = torch.cat([lay.values[:, :, :j], lay.values[:, :, j + 1 :]], 2)
        z_j, _ = _continue(net, evicted, fed, layer)
        dz = (z_j - z).reshape(K, 4, -1)  # (K, H, d_h): each head's state change
        do = torch.einsum("ehd,khd->khe", w_o, dz)  # (K, H, d): its projected change
        truth = do.norm(dim=-1).mean(0)  # (H,)
        np.testing.assert_allclose(res["truth"][:, j], truth.numpy(), rtol=1e-10, atol=1e-13)
        group = do.reshape(K, 2, 2, -1).sum(2).norm(dim=-1).mean(0)  # (G,)
        np.testing.assert_allclose(res["group_truth"][:, j], group.numpy(), rtol=1e-10, atol=1e-13)
        projected = ((do * o[:, None]).sum(-1).abs() / (o * o).sum(-1)[:, None]).mean(0)
        np.testing.assert_allclose(
            res["truth_projected"][:, j], projected.numpy(), rtol=1e-10, atol=1e-13
        )


def test_rank_statistics_match_their_definitions(geometry: Any) -> None:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(3, 40)), rng.normal(size=(3, 40))
    x[0, :10] = 0.5  # ties
    rho = geometry.spearman(x, y)
    for row in range(3):
        assert rho[row] == pytest.approx(spearmanr(x[row], y[row]).statistic, abs=1e-12)
    assert geometry.spearman(np.ones(5), np.arange(5.0)) == 0  # a constant side
    truth = np.array([5.0, 4, 3, 2, 1, 0])
    assert geometry.top_overlap(np.array([5.0, 0, 3, 2, 1, 4]), truth, 3) == pytest.approx(2 / 3)
    ranks = geometry.percentile_rank(np.array([[3.0, 1, 2]]))
    np.testing.assert_allclose(ranks, [[1.0, 0.0, 0.5]])


def test_one_item_runs_end_to_end_on_a_tiny_model(geometry: Any) -> None:
    model = tiny_model("llama", dtype=torch.float64)
    # long enough for the NLL check's 24 evicted tokens and a top-m overlap at ratio 0.75
    args = argparse.Namespace(context=48, window=8, continuation=K, nll_items=1)
    ids = _ids(48 + K + 1)
    items = [geometry.analyse_item(model, ids, args, item, sample=item == 0) for item in (0, 1)]
    first = items[0]
    n_head = len(geometry.HEAD_PREDICTORS) + len(geometry.ORACLES)
    assert np.array(first["rho_head"]).shape == (2, 4, n_head)
    rho = np.array(first["rho_head"])
    assert np.all(np.abs(rho) <= 1 + 1e-9)
    assert {"nll", "scatter", "points"} <= set(first) and "nll" not in items[1]
    rows = first["nll"]["rows"]
    assert [r["token"] for r in rows[: geometry.N_SINK]] == list(range(geometry.N_SINK))
    summary = geometry.summarise(items, first["layers"])
    assert set(summary["spearman_head"]) == {*geometry.HEAD_PREDICTORS, *geometry.ORACLES}
    assert set(summary["overlap"]) == {str(r) for r in geometry.RATIOS}
    shares = [v for r in summary["overlap"].values() for v in _numbers(r)]
    assert shares and all(0 <= v <= 1 for v in shares)  # overlaps are shares of keys
    assert {"paired", "top1", "token0_percentile", "amplification"} <= set(summary)


def _numbers(tree: Any) -> list[float]:
    """Every number in a nested dict of a summary's statistics."""
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in _numbers(v)]
    return [float(tree)] if isinstance(tree, (int, float)) else []
