"""Head-adaptive budgets (AdaKV): KV heads of a layer keep different counts.

Tiny random models in float64. The reference for continuing on an adaptive cache is
independent of the padding and the per-head mask: the model runs the continuation on the
*uncompressed* prefill cache through an eager float64 attention function of this file that
hides, per layer and KV head, the prefill keys that were evicted. The compressed cache
(padded slots, the attention of :mod:`contribution_weights.kv.heads`) must give the same
logits to 1e-10.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
from reference_kv import greedy_tokens, reference_logits
from tiny_models import tiny_model
from torch import Tensor

from contribution_weights import kv
from contribution_weights.kv import cache_keyword
from contribution_weights.kv.heads import with_padded_slots

T, N, WINDOW = 24, 6, 8


def _ids(length: int, seed: int, batch: int = 1) -> Tensor:
    return torch.randint(0, 99, (batch, length), generator=torch.Generator().manual_seed(seed))


def _evicted(small: kv.CompressedCache) -> dict[int, Tensor]:
    """Per layer, ``(B, G, T)`` True where the prefill entry was evicted (from ``kept``)."""
    drop = {}
    for layer, kept in small.kept.items():
        evicted = torch.ones(*kept.shape[:2], T + 1, dtype=torch.bool)
        evicted.scatter_(2, torch.where(kept < 0, T, kept), False)  # padded: a spare column
        drop[layer] = evicted[..., :T]
    return drop


def _check_continuation(
    model: Any, small: kv.CompressedCache, pre: kv.Prefill, ids: Tensor, tol: float = 1e-10
) -> None:
    """Two consecutive forwards on ``small`` equal the reference over the kept entries."""
    with torch.no_grad():
        first = small.forward(model.model, ids[:, T : T + 3]).logits
        second = small.forward(model.model, ids[:, T + 3 :]).logits
    got = torch.cat([first, second], dim=1)
    want = reference_logits(model.model, pre.cache, ids[:, T:], _evicted(small))
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    full = reference_logits(model.model, pre.cache, ids[:, T:], {})
    assert (full - got).abs().max() > 1e-4  # the eviction mattered


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text", "gpt2", "phi3"])
@pytest.mark.parametrize("method", ["adakv_snapkv", "adakv_contribution"])
def test_continuation_on_an_adaptive_cache_equals_attention_over_the_kept_entries(
    family: str, method: str
) -> None:
    model = tiny_model(family, dtype=torch.float64)
    ids = _ids(T + N, seed=3, batch=2)
    pre = kv.prefill(model, ids[:, :T], window=WINDOW)
    small = kv.compress(pre, method, 0.5)
    assert small.padded(), "the heads should keep different counts here"
    before = model.model.config._attn_implementation
    _check_continuation(model, small, pre, ids)
    assert model.model.config._attn_implementation == before  # restored


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_an_eager_model_gets_the_per_head_mask_too(family: str) -> None:
    """On the family's own eager attention. Llama's eager softmax runs in float32 even for
    float64 inputs, so there the reference (all float64) agrees to float32 rounding only;
    GPT-2's runs in the input's dtype, so to 1e-10."""
    model = tiny_model(family, dtype=torch.float64)
    model.model.set_attn_implementation("eager")
    ids = _ids(T + N, seed=4)
    pre = kv.prefill(model, ids[:, :T], window=WINDOW)
    small = kv.compress(pre, "adakv_contribution", 0.75)
    assert small.padded()
    _check_continuation(model, small, pre, ids, tol=1e-10 if family == "gpt2" else 1e-6)
    assert model.model.config._attn_implementation == "eager"


def _check_slots(
    small: kv.CompressedCache, pre: kv.Prefill, layer: int, protected: set[int]
) -> None:
    """Each head's kept entries come first (ascending, the prefill's keys and values), its
    padded slots after them (−1 in ``kept``, zero keys and values); ``protected`` kept."""
    kept, counts = small.kept[layer], small.counts[layer]
    cached, prefilled = small.cache.layers[layer], pre.cache.layers[layer]
    for b, head in [(b, h) for b in range(kept.shape[0]) for h in range(kept.shape[1])]:
        c, row = int(counts[b, head]), kept[b, head]
        assert (row[c:] == -1).all() and (row[:c].diff() > 0).all()
        assert protected <= set(row[:c].tolist())
        for got, full in ((cached.keys, prefilled.keys), (cached.values, prefilled.values)):
            assert torch.equal(got[b, head, :c], full[b, head, row[:c]])
            assert (got[b, head, c:] == 0).all()


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])  # GQA (G = 2 of H = 4) and G = H = 4
def test_the_layer_keeps_its_budget_and_each_head_its_safeguard(family: str) -> None:
    model = tiny_model(family, dtype=torch.float64)
    pre = kv.prefill(model, _ids(T, seed=5, batch=2), window=WINDOW)
    g = pre.cache.layers[next(iter(pre.stats))].keys.shape[1]
    for ratio, alpha, base in itertools.product(
        (0.25, 0.5, 0.75, 0.9),
        (0.0, 0.2, 0.5, 0.7),
        ("snapkv", "contribution", "renormalised", "knorm"),
    ):
        budget = kv.n_kept(T, ratio)
        method = kv.AdaKV(f"adakv_{base}_{alpha}", base=base, alpha_safeguard=alpha)
        safe = method.safeguard(budget)
        assert safe == math.ceil(round(alpha * budget, 9))
        small = kv.compress(pre, method, ratio)
        slots = {small.cache.layers[i].keys.shape[-2] for i in small.kept}
        assert len(slots) == 1  # one slot count S for every compressed layer
        (s,) = slots
        # the window's keys are protected by snapkv and contribution
        window = set(range(T - WINDOW, T)) if budget >= WINDOW and base != "knorm" else set()
        for layer, counts in small.counts.items():
            assert small.kept[layer].shape == (2, g, s) and int(counts.max()) <= s
            assert (counts.sum(-1) == g * budget).all(), (base, ratio, alpha)
            assert (counts >= safe).all()
            _check_slots(small, pre, layer, window)
        assert max(int(c.max()) for c in small.counts.values()) == s
        assert small.entries_kept == len(small.kept) * 2 * g * budget
        assert small.entries_stored == len(small.kept) * 2 * g * s
    assert kv.AdaKV("a", alpha_safeguard=0.7).safeguard(10) == 7  # not 8 (0.7 · 10 > 7)
    assert kv.AdaKV("a", alpha_safeguard=0.2).safeguard(12) == 3
    assert kv.AdaKV("a", alpha_safeguard=1.0).safeguard(5) == 5
    with pytest.raises(ValueError, match="alpha_safeguard"):
        kv.AdaKV("bad", alpha_safeguard=1.5)


def test_sinks_of_the_base_stay_kept() -> None:
    model = tiny_model("qwen2", dtype=torch.float64)
    pre = kv.prefill(model, _ids(T, seed=6), window=WINDOW)
    method = kv.AdaKV("adakv_sinks", base="contribution_sinks")
    for ratio in (0.5, 0.75):
        small = kv.compress(pre, method, ratio)
        for kept in small.kept.values():
            for row in kept.reshape(-1, kept.shape[-1]).tolist():
                assert {0, 1, 2, 3} <= set(row)


@pytest.mark.parametrize("base", ["snapkv", "contribution", "renormalised", "h2o", "tova"])
def test_a_full_safeguard_keeps_the_base_methods_own_sets(base: str) -> None:
    model = tiny_model("qwen2", dtype=torch.float64)
    pre = kv.prefill(model, _ids(T, seed=7, batch=2), window=WINDOW)
    for ratio in (0.25, 0.5, 0.9):
        got = kv.compress(pre, kv.AdaKV("ada1", base=base, alpha_safeguard=1.0), ratio)
        want = kv.compress(pre, base, ratio)
        assert not got.padded()
        for layer in want.kept:
            assert torch.equal(got.kept[layer], want.kept[layer]), (base, ratio, layer)
            a, b = got.cache.layers[layer], want.cache.layers[layer]
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_a_head_with_larger_scores_takes_more_of_the_budget(family: str) -> None:
    def loud_head(stats: kv.LayerStats) -> Tensor:
        gen = torch.Generator().manual_seed(stats.seed)
        scores = torch.rand(stats.keys.shape[:-1], generator=gen, dtype=torch.float64)
        scores[:, 0] *= 1000  # KV head 0's scores dwarf the others'
        return scores

    base = kv.Method.of("loud_head", loud_head, "head 0 scores x1000", needs=())
    model = tiny_model(family, dtype=torch.float64)
    ids = _ids(T + N, seed=8)
    pre = kv.prefill(model, ids[:, :T], window=WINDOW, methods=[base])
    for ratio in (0.5, 0.75):
        budget = kv.n_kept(T, ratio)
        method = kv.AdaKV("adakv_loud", base=base)
        safe = method.safeguard(budget)
        small = kv.compress(pre, method, ratio)
        for counts in small.counts.values():
            g = counts.shape[1]
            # head 0 takes all it can: everything but the other heads' safeguards
            most = g * budget - (g - 1) * safe
            assert int(counts[0, 0]) == min(T, most) > budget
            if most <= T:
                assert (counts[0, 1:] == safe).all()
        _check_continuation(model, small, pre, ids)


def test_generate_after_an_adakv_compression_matches_a_manual_greedy_loop() -> None:
    model = tiny_model("qwen2", dtype=torch.float64)
    ids = _ids(T + 3, seed=9)
    pre = kv.prefill(model, ids[:, :T], window=WINDOW)
    small = kv.compress(pre, "adakv_contribution", 0.5)
    assert small.padded()
    gen = small.generate(model.model, ids[:, T:], max_new_tokens=5, do_sample=False)
    manual = kv.compress(pre, "adakv_contribution", 0.5)
    tokens = greedy_tokens(manual, model.model, ids[:, T:], 5)
    assert torch.equal(gen, tokens)
    assert model.model.config._attn_implementation == "sdpa"
    # and the greedy tokens are those of the reference over the kept entries
    want = reference_logits(model.model, pre.cache, tokens[:, :-1], _evicted(manual))
    assert torch.equal(want[:, 2:].argmax(-1), tokens[:, 3:])


def test_equal_count_methods_have_no_padding_and_change_nothing() -> None:
    model = tiny_model("qwen2", dtype=torch.float64)
    ids = _ids(T + N, seed=10)
    pre = kv.prefill(model, ids[:, :T], window=WINDOW)
    for method in ("snapkv", "contribution", "knorm"):
        small = kv.compress(pre, method, 0.5)
        assert small.padded() == {}
        assert small.entries_kept == small.entries_stored == 2 * 2 * kv.n_kept(T, 0.5)
        assert all(bool((c == kv.n_kept(T, 0.5)).all()) for c in small.counts.values())
        with torch.no_grad():
            got = small.forward(model.model, ids[:, T:]).logits
            plain = model.model(
                input_ids=ids[:, T:],
                **{cache_keyword(model.model): kv.compress(pre, method, 0.5).cache},
                position_ids=torch.arange(T, T + N)[None],
            ).logits
        assert torch.equal(got, plain)  # the model's own path, bit for bit
    assert not kv.get_method("snapkv").head_adaptive
    assert {"adakv_snapkv", "adakv_contribution", "adakv_renormalised"} <= set(kv.method_names())
    assert kv.get_method("adakv_contribution").base_method.name == "contribution"  # type: ignore[attr-defined]
    needs = kv.methods.method_needs(kv.get_method("adakv_renormalised"))
    assert needs == ("window_renormalised",)


def test_the_per_head_mask_of_each_kind() -> None:
    """None (causal, queries last), boolean and additive masks get the padded slots of
    each KV head, expanded over its query heads."""
    padded = torch.tensor([[[False, True, False], [False, False, True]]])  # (1, G=2, S=3)
    q_len, k_len = 2, 5
    got = with_padded_slots(None, padded, num_heads=4, q_len=q_len, k_len=k_len)
    causal = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert got.shape == (1, 4, 2, 5) and got.dtype == torch.bool
    for h in range(4):
        want = causal.clone()
        want[:, 1 if h < 2 else 2] = False
        assert torch.equal(got[0, h], want), h
    boolean = with_padded_slots(causal[None, None], padded, 4, q_len, k_len)
    assert torch.equal(boolean, got)
    low = torch.finfo(torch.float64).min
    additive = torch.zeros(1, 1, q_len, k_len, dtype=torch.float64).masked_fill(~causal, low)
    out = with_padded_slots(additive, padded, 4, q_len, k_len)
    assert torch.equal(out == 0, got) and bool((out[~got] == low).all())


def test_adakv_runs_in_kv_eval() -> None:
    from contribution_weights.experiments.kv_eval import KVEvalOptions, kv_eval

    model = tiny_model("llama")
    opts = KVEvalOptions(
        task="passkey", methods="adakv_snapkv,adakv_renormalised", ratios=[0, 0.5],
        context_tokens=256, n=2, window=8,
    )  # fmt: skip
    result = kv_eval(model, options=opts, progress=False)
    assert set(result.summary["method"]) == {"none", "adakv_snapkv", "adakv_renormalised"}
    assert result.per_item["accuracy"].notna().all()
