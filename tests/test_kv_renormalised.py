"""The renormalised effect of evicting a cache entry (kv/renormalised.py, the methods
``renormalised`` and ``renormalised_sinks``), in float64.

The reference is an explicit eviction: the softmax is taken again without key j (from
the logits, or by renormalising the model's own α over the other keys), the head's
projected output recomputed with the projected values W_O^(h) v_k, and the old output
subtracted. Nothing of the package's maths is used for it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers as tf
from reference import eager_run, projected_values
from tiny_models import CharTokenizer, tiny_model
from torch import Tensor, nn

from contribution_weights import LoadedModel, kv
from contribution_weights.kv.renormalised import renormalised_effect

F64 = torch.float64
T, WINDOW = 24, 8


def _ids(length: int, seed: int) -> Tensor:
    return torch.randint(0, 99, (1, length), generator=torch.Generator().manual_seed(seed))


def _evict_from_logits(logits: Tensor, vt: Tensor) -> Tensor:
    """``(B, H, w, T)`` ‖o_i(without j) − o_i‖: softmax again over the logits without key j."""
    out = logits.softmax(-1) @ vt
    effect = torch.zeros(logits.shape, dtype=F64)
    for j in range(logits.shape[-1]):
        without = logits.clone()
        without[..., j] = float("-inf")
        effect[..., j] = (without.softmax(-1) @ vt - out).norm(dim=-1)
    return torch.where(logits.isfinite(), effect, 0.0)  # a key the query cannot see: 0


def _random_window(
    seed: int, sink: list[float], b: int = 2, h: int = 3, t: int = 9, d: int = 6, dh: int = 4
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Logits of the last ``len(sink)`` queries (causal), values ``(B, H, T, d_h)``, per-head
    output blocks ``(H, d, d_h)`` and projected values; key 0 gets ``sink[i]`` added to
    query i's logit (a sink of growing weight)."""
    gen = torch.Generator().manual_seed(seed)
    w = len(sink)
    logits = torch.randn(b, h, w, t, generator=gen, dtype=F64)
    logits[..., 0] += torch.tensor(sink, dtype=F64)
    visible = torch.ones(w, t, dtype=torch.bool).tril(t - w)
    logits = logits.masked_fill(~visible, float("-inf"))
    values = torch.randn(b, h, t, dh, generator=gen, dtype=F64)
    w_o = torch.randn(h, d, dh, generator=gen, dtype=F64)
    return logits, values, w_o, torch.einsum("bhtd,hed->bhte", values, w_o)


def test_formula_equals_an_explicit_eviction() -> None:
    """α_ij ‖o_i − ṽ_j‖ / (1 − α_ij) against the softmax recomputed without key j, to 1e-10,
    both on the projected vectors and on (z_i, v_j) in the metric W_Oᵀ W_O; sinks up to
    α ≈ 0.999."""
    logits, values, w_o, vt = _random_window(0, sink=[0.0, 2.0, 5.0, 9.0, 0.0])
    probs = logits.softmax(-1)
    assert float(probs[..., 3, 0].min()) > 0.99  # a strong sink is in the test
    want = _evict_from_logits(logits, vt)
    projected = renormalised_effect(probs, vt, probs @ vt)
    gram = w_o.transpose(1, 2) @ w_o
    small = renormalised_effect(probs, values, probs @ values, gram)
    torch.testing.assert_close(projected, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(small, want, rtol=1e-10, atol=1e-10)
    # it is not the change without renormalisation, α_ij ‖ṽ_j‖ (the test can fail)
    first_order = probs * vt.norm(dim=-1)[:, :, None]
    assert float((want - first_order).abs().max()) > 1e-2
    assert bool((projected[probs == 0] == 0).all())  # keys a query cannot see: no effect


def test_a_saturated_key_gets_the_upper_bound_and_nothing_is_infinite() -> None:
    """1 − α_ij ≤ 16 ε (a key holding all the attention to working precision, or a query's
    only key): α_ij (‖ṽ_j‖ + max_k ‖ṽ_k‖), which bounds the exact change from above."""
    logits, _, _, vt = _random_window(1, sink=[60.0, 0.0, 3.0], t=5)
    logits[:, :, 1, 1:] = float("-inf")  # query 1 sees key 0 only
    probs = logits.softmax(-1)
    got = renormalised_effect(probs, vt, probs @ vt)
    assert bool(got.isfinite().all())
    saturated = 1 - probs <= 16 * torch.finfo(F64).eps
    assert bool(saturated[..., 0, 0].all()) and bool(saturated[..., 1, 0].all())
    assert int(saturated.sum()) == 2 * probs.shape[0] * probs.shape[1]  # those two only
    norms = vt.norm(dim=-1)  # (B, H, T)
    bound = probs * (norms[:, :, None] + norms.amax(-1)[:, :, None, None])
    torch.testing.assert_close(got[saturated], bound[saturated])
    exact = _evict_from_logits(logits[:, :, ::2], vt)  # queries 0 and 2 (query 1: no key left)
    assert bool((exact[..., 0, 0] <= got[..., 0, 0]).all())  # query 0: the others ≈ e^-60
    torch.testing.assert_close(got[:, :, 2], exact[:, :, 1], rtol=1e-10, atol=1e-10)
    assert bool((got[:, :, 1, 1:] == 0).all())


def test_near_saturation_the_most_attended_key_is_computed_without_cancellation() -> None:
    """In float32, a sink with 1 − α ≈ 1e-5: the most attended key's ‖o_i − ṽ_j‖ is formed
    as a difference, so the effect keeps its precision where the expansion
    ‖o‖² − 2 o·ṽ + ‖ṽ‖² (clamped) has none left."""
    logits, _, _, vt = _random_window(2, sink=[12.0, 12.0, 12.0])
    probs = logits.softmax(-1)
    rest = 1 - probs[..., 0]
    assert float(rest.min()) > 1e-6 and float(rest.max()) < 1e-3
    want = _evict_from_logits(logits, vt)[..., 0]
    p32, v32 = probs.float(), vt.float()
    o32 = (probs @ vt).float()  # the exact output, rounded once
    got = renormalised_effect(p32, v32, o32)[..., 0].to(F64)
    assert float(((got - want) / want).abs().max()) < 0.02
    expanded = (o32.square().sum(-1) - 2 * (o32 * v32[:, :, None, 0]).sum(-1)
                + v32[:, :, None, 0].square().sum(-1)).clamp_min(0)  # fmt: skip
    naive = (p32[..., 0] * expanded.sqrt() / (1 - p32[..., 0])).to(F64)
    assert float(((naive - want) / want).abs().max()) > 0.2


# ---- the statistic a prefill gathers, against the model's own q, k, v and W_O ------------
_recorded: dict[int, tuple[Tensor, Tensor, float]] = {}  # layer -> (query, key, scaling)


def _recording_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    **_: Any,
) -> tuple[Tensor, None]:
    """Eager attention (float64 softmax) that records each layer's queries and keys."""
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    _recorded[int(module.layer_idx)] = (query.detach(), key.detach(), scale)  # type: ignore[arg-type]
    rep = query.shape[1] // key.shape[1]
    scores = query @ key.repeat_interleave(rep, dim=1).transpose(2, 3) * scale
    if attention_mask is not None:
        mask = attention_mask[:, :, :, : key.shape[2]]
        scores = (
            scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        )
    out = scores.softmax(-1) @ value.repeat_interleave(rep, dim=1)
    return out.transpose(1, 2).contiguous(), None


def _queries_and_keys(model: nn.Module, ids: Tensor) -> dict[int, tuple[Tensor, Tensor, float]]:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    name = "kv_renormalised_recorder"
    AttentionInterface.register(name, _recording_attention)
    AttentionMaskInterface.register(name, eager_mask)
    previous = model.config._attn_implementation
    _recorded.clear()
    try:
        model.set_attn_implementation(name)
        with torch.no_grad():
            model(input_ids=ids)
        return dict(_recorded)
    finally:
        model.set_attn_implementation(previous)


def _mqa_llama() -> LoadedModel:
    """A tiny Llama with 4 query heads sharing one KV head (a GQA group of 4)."""
    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128,
        attention_bias=True,
    )  # fmt: skip
    model = tf.AutoModelForCausalLM.from_config(config).to(F64).eval()
    return LoadedModel(model=model, tokenizer=CharTokenizer(), name="tiny-llama-mqa")


def _model(name: str) -> LoadedModel:
    return _mqa_llama() if name == "llama_mqa" else tiny_model(name, dtype=F64)


def _explicit_window_effect(run: Any, layer: int, window: int) -> Tensor:
    """``(H, T)`` Σ over the last ``window`` queries of ‖Δo_ij^(h)‖, evicting key j from the
    model's own α: the softmax without key j gives key k the weight
    e^{s_k} / (Z − e^{s_j}) = α_ik / (1 − α_ij); ṽ = W_O^(h) v. (Dividing by the rest's sum
    instead would also undo the float32 rounding of the model's softmax, ~1e-7.)"""
    probs = run.probs[layer][0, :, T - window :]  # (H, w, T)
    vt = projected_values(run.values[layer][0], run.weights[layer])  # (H, T, d)
    out = probs @ vt
    total = torch.zeros(probs.shape[0], T, dtype=F64)
    for j in range(T):
        without = probs.clone()
        without[..., j] = 0
        without = without / (1 - probs[..., j : j + 1])
        total[:, j] = ((without @ vt - out).norm(dim=-1) * (probs[..., j] > 0)).sum(-1)
    return total


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2", "llama_mqa"])
def test_the_prefill_gathers_the_effect_of_an_explicit_eviction(name: str) -> None:
    """Σ over the window of ‖Δo_ij^(h)‖ as the prefill gathers it (on the capture path, in
    the Gram metric) equals an explicit eviction from the model's own α, v and W_O (1e-10);
    that eviction equals the softmax recomputed from the model's own q and k without key j
    (to the float32 rounding of its eager softmax)."""
    model = _model(name)
    ids = _ids(T, seed=21)
    pre = kv.prefill(model, ids, window=WINDOW)  # every method: all layers eager
    run = eager_run(model.model, ids)
    recorded = _queries_and_keys(model.model, ids)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[T - WINDOW :]
    for layer, stats in pre.stats.items():
        want = _explicit_window_effect(run, layer, WINDOW)
        torch.testing.assert_close(stats.window_renormalised[0], want, rtol=1e-10, atol=1e-12)
        query, key, scale = recorded[layer]
        rep = query.shape[1] // key.shape[1]
        logits = query[:, :, T - WINDOW :] @ key.repeat_interleave(rep, 1).transpose(2, 3) * scale
        logits = logits.masked_fill(~causal, float("-inf"))
        vt = projected_values(run.values[layer][0], run.weights[layer])[None]
        from_qk = _evict_from_logits(logits, vt).sum(2)[0]
        torch.testing.assert_close(from_qk, want, rtol=1e-5, atol=1e-8)


# ---- the methods ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["qwen2", "llama_mqa"])
def test_compress_by_renormalised_keeps_the_budget_the_window_and_the_sinks(name: str) -> None:
    """A window-only prefill (sdpa layers) gathers only the effect; the score is its sum over
    the query heads of each KV group; compress keeps n_kept per KV head, the window's keys
    (and, for ``renormalised_sinks``, the first 4) first."""
    model = _model(name)
    ids = _ids(T, seed=22)
    methods = ["renormalised", "renormalised_sinks"]
    pre = kv.prefill(model, ids, window=WINDOW, methods=methods)
    full = kv.prefill(model, ids, window=WINDOW)
    g = model.model.config.num_key_value_heads
    for layer, stats in pre.stats.items():
        assert stats.attn_sum is None and stats.window_probs is None
        assert stats.window_contribution is None and stats.window_queries is None
        effect = stats.window_renormalised  # (B, H, T)
        torch.testing.assert_close(
            effect, full.stats[layer].window_renormalised, rtol=1e-6, atol=1e-8
        )
        grouped = torch.stack([part.sum(1) for part in effect.chunk(g, dim=1)], dim=1)
        score = kv.get_method("renormalised").score(stats)
        assert score.shape == (1, g, T)
        torch.testing.assert_close(score[..., : T - WINDOW], grouped[..., : T - WINDOW])
        assert bool((score[..., T - WINDOW :].min(-1).values > grouped.max()).all())
    for ratio in (0.25, 0.5, 0.75):
        budget = kv.n_kept(T, ratio)
        for method in methods:
            small = kv.compress(pre, method, ratio)
            for layer, kept in small.kept.items():
                assert kept.shape == (1, g, budget), (method, layer)
                assert small.cache.layers[layer].keys.shape[-2] == budget
                for row in kept.reshape(-1, budget).tolist():
                    assert len(set(row)) == budget
                    protected = set(range(T - WINDOW, T))
                    if method == "renormalised_sinks":
                        protected = set(range(4)) | (protected if budget >= 12 else set())
                    if budget >= len(protected):
                        assert protected <= set(row), (method, ratio, row)


def test_a_shorter_method_window_equals_a_shorter_prefill() -> None:
    """Renormalised(window=4) on an 8-query observation window keeps what ``renormalised``
    keeps after a 4-query prefill (the prefill sums the last 4 queries separately)."""
    model = tiny_model("qwen2", dtype=F64)
    ids = _ids(T, seed=23)
    short = kv.prefill(model, ids, window=4, methods=["renormalised"])
    unit = kv.Renormalised("renormalised4", window=4, sinks=2)
    wide = kv.prefill(model, ids, window=WINDOW, methods=[unit])
    got = kv.compress(wide, unit, 0.5)
    want = kv.compress(short, kv.Renormalised("r", sinks=2), 0.5)
    for layer in want.kept:
        assert torch.equal(got.kept[layer], want.kept[layer]), layer
        torch.testing.assert_close(
            wide.stats[layer].renormalised_by_window[4], short.stats[layer].window_renormalised
        )
    assert {"renormalised", "renormalised_sinks"} <= set(kv.method_names())
