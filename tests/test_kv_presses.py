"""Our methods as kvpress presses (``cw.kv.presses``), without kvpress where possible.

The presses rebuild each layer's :class:`LayerStats` from what a kvpress forward hook is
shown (the attention module, its input hidden states, the cached keys and values, the
forward's ``position_embeddings``); here those rebuilt statistics must equal the ones our
own prefill gathers on the capture path, on tiny float64 models of the families kvpress
supports (GQA with biases, query norms, soft-capping, sliding-window layers, a fused qkv
projection), and every method must score and keep alike on both. kvpress itself lives in
its own environment (``make kvpress-check``); the one test that needs it skips here.
"""

from __future__ import annotations

import sys

import pytest
import torch

import contribution_weights as cw
from contribution_weights.families import UnsupportedModelError
from contribution_weights.kv import presses
from contribution_weights.kv.cache import n_kept
from contribution_weights.kv.methods import STATISTICS, method_needs
from contribution_weights.kv.presses import is_sliding, layer_stats, prefill_queries

F64 = torch.float64
WINDOW = 16
SHORT = 8  # a method's own shorter window
FAMILIES = ["llama", "qwen3", "gemma3_text", "gemma2", "phi3"]


def _methods() -> list[cw.kv.Method]:
    return [
        *(cw.kv.get_method(n) for n in cw.kv.method_names()),
        cw.kv.Contribution("contribution_short", window=SHORT, sinks=4),
        cw.kv.Renormalised("renormalised_short", window=SHORT),
        cw.kv.SnapKV("snapkv_short", window=SHORT),
    ]


def _hooked(model: cw.LoadedModel, ids: torch.Tensor) -> tuple[dict[int, tuple], object]:
    """What a kvpress hook is shown per layer (module, hidden states, position embeddings),
    from a plain eager forward, and the cache it filled."""
    net = model.model
    net.set_attn_implementation("eager")  # our prefill's attention is eager's, to the bit
    seen: dict[int, tuple] = {}

    def hook(module, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        seen[module.layer_idx] = (module, hidden, kwargs.get("position_embeddings"))

    handles = [
        layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True)
        for layer in net.model.layers
    ]
    try:
        with torch.no_grad():
            out = net(input_ids=ids, use_cache=True)
    finally:
        for handle in handles:
            handle.remove()
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    return seen, cache


def _both(family: str, length: int = 40):
    from tiny_models import tiny_model

    model = tiny_model(family, dtype=F64)
    ids = torch.randint(0, 99, (1, length), generator=torch.Generator().manual_seed(3))
    pre = cw.kv.prefill(model, ids, window=WINDOW, methods=_methods())
    seen, cache = _hooked(model, ids)
    rebuilt = {}
    for i in pre.stats:
        module, hidden, pe = seen[i]
        layer = cache.layers[i]
        with torch.no_grad():
            rebuilt[i] = layer_stats(
                module, hidden, layer.keys, layer.values, pe, window=WINDOW, windows=(SHORT,)
            )
    return model, pre, rebuilt, seen


@pytest.mark.parametrize("length", [40, 10], ids=["window<T", "T<window"])
@pytest.mark.parametrize("family", FAMILIES)
def test_rebuilt_statistics_equal_the_prefills(family, length):
    _, pre, rebuilt, seen = _both(family, length)
    assert pre.stats, "every layer of the tiny model is sliding"
    # the presses skip exactly the layers our prefill does not compress
    assert {i for i, (m, _, _) in seen.items() if not is_sliding(m)} == set(pre.stats)
    for i, ours in pre.stats.items():
        mine = rebuilt[i]
        for name in ("keys", "values", *STATISTICS):
            a, b = getattr(ours, name), getattr(mine, name)
            assert a is not None and b is not None, (i, name)
            torch.testing.assert_close(b, a, rtol=0, atol=1e-12, msg=f"layer {i}: {name}")
        for attr in ("contribution_by_window", "renormalised_by_window"):
            a, b = getattr(ours, attr), getattr(mine, attr)
            assert a.keys() == b.keys(), (i, attr)
            for w in a:
                torch.testing.assert_close(b[w], a[w], rtol=0, atol=1e-12)
        assert (mine.scaling, mine.seed, mine.window) == (ours.scaling, ours.seed, ours.window)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_every_method_scores_and_keeps_alike(family):
    _, pre, rebuilt, _ = _both(family)
    for method in _methods():
        for ratio in (0.25, 0.75):
            for i, ours in pre.stats.items():
                kept = n_kept(ours.length, ratio)
                a = method.score_for_budget(ours, kept)
                b = method.score_for_budget(rebuilt[i], kept)
                torch.testing.assert_close(b, a, rtol=0, atol=1e-12, msg=method.name)
                if method.head_adaptive:
                    same = method.kept_mask(rebuilt[i], kept) == method.kept_mask(ours, kept)
                    assert bool(same.all()), method.name
                else:
                    assert torch.equal(
                        cw.kv.kept_positions(b, ratio), cw.kv.kept_positions(a, ratio)
                    ), method.name


def test_only_what_is_needed_is_rebuilt():
    from tiny_models import tiny_model

    model = tiny_model("llama", dtype=F64)
    ids = torch.randint(0, 99, (1, 24), generator=torch.Generator().manual_seed(0))
    seen, cache = _hooked(model, ids)
    module, hidden, pe = seen[1]
    keys, values = cache.layers[1].keys, cache.layers[1].values
    bare = layer_stats(module, hidden, keys, values, pe, needs=())
    assert all(getattr(bare, name) is None for name in STATISTICS)
    assert bare.seed == 1 and torch.equal(bare.keys, keys)
    probs = layer_stats(module, hidden, keys, values, pe, needs=("window_probs",), window=8)
    assert probs.window_probs is not None and probs.window_probs.shape == (1, 4, 8, 24)
    assert probs.attn_sum is None and probs.window_contribution is None
    # the rows sum to 1 over the keys each query sees, and no query sees a later key
    torch.testing.assert_close(probs.window_probs.sum(-1), torch.ones(1, 4, 8, dtype=F64))
    assert float(probs.window_probs[..., 0, 17:].abs().max()) == 0.0


def test_clear_errors():
    from tiny_models import tiny_model

    model = tiny_model("llama", dtype=F64)
    ids = torch.randint(0, 99, (1, 12), generator=torch.Generator().manual_seed(0))
    seen, cache = _hooked(model, ids)
    module, hidden, pe = seen[0]
    keys, values = cache.layers[0].keys, cache.layers[0].values
    with pytest.raises(ValueError, match="unknown statistics"):
        layer_stats(module, hidden, keys, values, pe, needs=("attention",))
    with pytest.raises(ValueError, match="scores the prefill"):
        layer_stats(module, hidden[:, 1:], keys, values, pe)
    gpt2 = tiny_model("gpt2", dtype=F64)
    attn = gpt2.model.transformer.h[0].attn
    with pytest.raises(UnsupportedModelError, match="q_proj"):
        prefill_queries(attn, torch.zeros(1, 3, 32, dtype=F64), None)


def test_the_press_without_kvpress_says_where_it_lives(monkeypatch):
    """Importing the module needs no kvpress; asking for a press without it names the extra,
    its pins and the separate environment."""
    monkeypatch.setitem(sys.modules, "kvpress", None)  # `import kvpress` raises ImportError
    presses._press_classes.cache_clear()
    try:
        with pytest.raises(ImportError) as err:
            presses.press("contribution", 0.5)
    finally:
        presses._press_classes.cache_clear()
    text = str(err.value)
    for part in (
        "kvpress 0.5.5",
        "contribution-weights[kvpress]",
        "transformers>=5.0,<5.3",
        "separate virtual environment",
        "make kvpress-check",
        ".venv-kvpress",
    ):
        assert part in text, part


def test_the_module_imports_no_kvpress_and_no_transformers():
    import subprocess

    code = (
        "import sys, contribution_weights.kv.presses as p; "
        "print(sorted(m for m in ('kvpress', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_press_in_kvpress_keeps_the_methods_entries():
    """Where kvpress is installed (.venv-kvpress): our press inside kvpress's context
    manager leaves each layer the entries our method keeps on the same statistics."""
    pytest.importorskip("kvpress")
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    model = tf.LlamaForCausalLM(config).to(F64).eval()
    model.set_attn_implementation("eager")
    ids = torch.randint(0, 99, (1, 40), generator=torch.Generator().manual_seed(1))
    full = tf.DynamicCache()
    seen: dict[int, tuple] = {}

    def hook(module, args, kwargs):
        seen[module.layer_idx] = (module, kwargs["hidden_states"], kwargs["position_embeddings"])

    handles = [
        layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True)
        for layer in model.model.layers
    ]
    with torch.no_grad():
        model(input_ids=ids, past_key_values=full)
    for handle in handles:
        handle.remove()
    for name in ("contribution_sinks", "renormalised", "snapkv", "h2o", "streaming_llm"):
        method = cw.kv.get_method(name)
        p = presses.press(name, 0.5, window=WINDOW)
        cache = tf.DynamicCache()
        with torch.no_grad(), p(model):
            model(input_ids=ids, past_key_values=cache)
        for i, (module, hidden, pe) in seen.items():
            layer = full.layers[i]
            stats = layer_stats(
                module, hidden, layer.keys, layer.values, pe, needs=method_needs(method),
                window=WINDOW,
            )  # fmt: skip
            keep = cw.kv.kept_positions(method.score_for_budget(stats, 20), 0.5)
            kept = cache.layers[i].keys  # (B, G, 20, d_h), in kvpress's top-k order
            assert kept.shape[2] == 20
            same = (kept[:, :, :, None] == layer.keys[:, :, None]).all(-1)  # (B, G, 20, T)
            assert bool((same.sum(-1) == 1).all()), name  # each one of the prefill's keys
            assert torch.equal(same.int().argmax(-1).sort(-1).values, keep), name
