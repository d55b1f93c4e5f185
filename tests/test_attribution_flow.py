"""Contribution flow (method §7) against the naive float64 reference of :mod:`reference_flow`.

The reference runs each tiny model on its own eager attention with plain hooks and builds
every object of §7 explicitly: the ``(T, T)`` mixing matrices, their products, the sum over
layers and tokens of §7.3, rollout and the ALTI-style rule. The library carries one row per
target from the top layer down and never builds a ``T × T`` matrix.

Tolerance. The models are float64 and the library is asked for float64, yet the two sides
agree only to about 1e-7 of the scores' scale, not 1e-15: every family but GPT-2 takes
its attention softmax in float32 (the eager α that the reference reads, and the α the
library recomputes block by block), and Llama's and Gemma's RMSNorms compute in float32.
The library's own forward runs on sdpa, which in float64 does not round α to float32, so its
residual streams differ from eager's by float32 rounding too. Across the families and
targets here the largest difference is 5e-7 of max |score| (GPT-2, whose softmax stays
float64: 1e-15). ``REL_TOL = 2e-6`` of the scale leaves a factor of 4 and is still
about 1e4 below the size of any real mistake (a layer, a head, the residual share or the
feed-forward term misplaced moves the scores by 1e-2 of their scale or more).
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers as tf
from reference_flow import (
    Run,
    alti,
    eager_flow_run,
    one_layer_by_hand,
    pure_flow,
    rollout,
    target_attribution,
)
from tiny_models import FAMILIES, CharTokenizer, config_for, tiny_model

from contribution_weights import LoadedModel
from contribution_weights.attribution.flow import RULES, FlowOutput, forward_factors, propagate
from contribution_weights.attribution.targets import Target, targets_for

F64 = torch.float64
REL_TOL = 2e-6
T = 10
POSITION = 7  # not the last: scores then have width POSITION + 1 < T
FOIL = 3
IDS = torch.randint(0, 99, (T,), generator=torch.Generator().manual_seed(3))
QUANTITIES = ["flow", "logit", "logprob", "contrast"]
# tiny configs in which nothing but the tokens feeds the residual stream: no output-projection
# bias, no final-norm bias, no unembedding bias (Qwen 2's q/k/v biases are inside v_j)
BIAS_FREE = ["mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3"]


def spread(loaded: LoadedModel, seed: int = 0) -> LoadedModel:
    """Weights of standard deviation 0.3 (and norm gains away from 1): peaked attention,
    attention updates as large as the residual stream, soft-capping that bites. The default
    initialisation (0.02) leaves α nearly uniform."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in loaded.model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=F64).to(param.dtype)
            if param.dim() >= 2:
                param.copy_(0.3 * noise)
            elif name.endswith("weight"):  # norm gains
                param.add_(0.2 * noise)
    return loaded


def model_for(family: str, weights: str = "spread") -> LoadedModel:
    loaded = tiny_model(family, dtype=F64)
    return spread(loaded) if weights == "spread" else loaded


def one_layer_model(family: str) -> LoadedModel:
    cfg = config_for(family)
    cfg.num_hidden_layers = 1
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = cfg.layer_types[:1]
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).to(F64).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.1)
    return spread(LoadedModel(model=model, tokenizer=CharTokenizer(), name=f"one-{family}"))


def library(
    loaded: LoadedModel,
    targets: list[Target],
    rule: str = "flow",
    block_bytes: int = 32 * 1024**2,
    ids: torch.Tensor = IDS,
) -> FlowOutput:
    fwd, resolved = forward_factors(
        loaded,
        ids,
        targets,
        dtype=F64,
        keep_states=rule == "alti",
        block_bytes=block_bytes,
    )
    return propagate(loaded, fwd, resolved, rule=rule)


def naive_scores(run: Run, target: Target) -> tuple[torch.Tensor, float]:
    """The reference's scores (T,) and what no token receives."""
    if target.quantity == "flow":
        row = pure_flow(run, target.position)
        return row, 1.0 - float(row.sum())
    assert target.token is not None
    got = target_attribution(run, target.position, target.quantity, target.token, target.foil)
    return got.scores, got.bias


def assert_scores(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """``actual`` (T',) against ``expected`` (T,): equal on 0…T'−1, zero beyond."""
    width = actual.shape[0]
    scale = float(expected.abs().max())
    assert scale > 0, what
    assert not bool(expected[width:].any()), f"{what}: mass after the target"
    err = float((actual.to(F64) - expected[:width]).abs().max())
    assert err <= REL_TOL * scale, f"{what}: max error {err:.3g} (scale {scale:.3g})"


def target(quantity: str, position: int = POSITION) -> list[Target]:
    foil = FOIL if quantity == "contrast" else None
    return targets_for(T, position=position, quantity=quantity, foil=foil)


# ---- the reference itself -------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_reference_is_consistent(family):
    """The naive pieces against what the model computed: o from α, v and W_O against the
    output projection's output; s ⊙ o against the post-attention norm; the final norm and
    the (soft-capped) logits; rows of A plus the bias share sum to 1; §7.3 decomposes."""
    loaded = model_for(family)
    run = eager_flow_run(loaded.model, IDS)
    for idx, layer in enumerate(run.layers):
        o = (layer.probs[..., None] * layer.projected[:, None]).sum((0, 2)) + layer.bias
        hooked = run.outputs[idx]
        assert torch.allclose(o, hooked, rtol=0, atol=1e-12 * float(hooked.abs().max()))
        normed = run.normed[idx]
        if normed is not None:  # Gemma's norm computes in float32
            assert torch.allclose(layer.scale * o, normed, rtol=0, atol=1e-6)
        rows = layer.mixing.sum(1) + layer.beta
        assert torch.allclose(rows, torch.ones(T, dtype=F64), rtol=0, atol=1e-12)
        assert torch.equal(layer.mixing.triu(1), torch.zeros(T, T, dtype=F64))  # causal
    assert torch.allclose(run.norm(run.x_final), run.norm_out, rtol=0, atol=1e-6)
    cap = run.softcap
    logits = run.raw_logits if cap is None else cap * torch.tanh(run.raw_logits / cap)
    assert torch.allclose(logits, run.logits, rtol=0, atol=1e-12)
    for quantity in ("logit", "logprob", "contrast"):
        got = target_attribution(run, POSITION, quantity, 5, FOIL)
        total = float(got.scores.sum()) + got.bias
        assert math.isclose(total, got.explained, rel_tol=1e-12, abs_tol=1e-12)


# ---- 1. the library against the reference ---------------------------------------------------
@pytest.mark.parametrize("weights", ["tiny", "spread"])
@pytest.mark.parametrize("quantity", QUANTITIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_scores_equal_naive(family, quantity, weights):
    loaded = model_for(family, weights)
    run = eager_flow_run(loaded.model, IDS)
    out = library(loaded, target(quantity))
    assert out.scores.shape == (1, POSITION + 1)
    expected, _ = naive_scores(run, out.targets[0])
    assert_scores(out.scores[0], expected, f"{family} {quantity}")


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_of_one_query(family):
    """The library visits queries block by block: one query per block changes nothing."""
    loaded = model_for(family)
    run = eager_flow_run(loaded.model, IDS)
    for quantity in ("flow", "logit"):
        out = library(loaded, target(quantity), block_bytes=1)
        expected, _ = naive_scores(run, out.targets[0])
        assert_scores(out.scores[0], expected, f"{family} {quantity} (blocks of 1)")
    out = library(loaded, target("flow"), rule="alti", block_bytes=1)
    assert_scores(out.scores[0], alti(run, POSITION), f"{family} alti (blocks of 1)")


# ---- 2. completeness ------------------------------------------------------------------------
@pytest.mark.parametrize("quantity", QUANTITIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_completeness(family, quantity):
    loaded = model_for(family)
    run = eager_flow_run(loaded.model, IDS)
    out = library(loaded, target(quantity))
    t = out.targets[0]
    _, naive_rest = naive_scores(run, t)
    scores = out.scores[0]
    scale = float(scores.abs().sum())
    remainder = float(out.remainder[0])
    whole = 1.0 if quantity == "flow" else float(out.explained[0])
    # structurally bias-free: no output-projection bias in any layer, no final-norm bias
    bias_free = (
        all(not bool(layer.bias.any()) for layer in run.layers)
        and run.norm.bias is None
        and run.unembed_bias is None
    )
    assert bias_free == (family in BIAS_FREE)
    assert math.isclose(float(scores.sum()) + remainder, whole, rel_tol=1e-12, abs_tol=1e-12)
    if bias_free:
        # not to 1e-15: the library's α (float32 softmax) is not the α its sdpa forward used,
        # so rows of A^l sum to 1 only to float32 rounding (exactly in GPT-2)
        assert abs(float(scores.sum()) - whole) <= REL_TOL * scale
        assert abs(remainder) <= REL_TOL * scale
    else:
        assert abs(naive_rest) > 1e-5 * scale  # the biases do receive something
        assert abs(remainder - naive_rest) <= REL_TOL * scale
    if quantity == "flow":
        assert math.isnan(float(out.explained[0])) and math.isnan(float(out.values[0]))
        return
    assert t.token is not None
    logits = run.logits[t.position]  # the eager model's (soft-capped) logits
    if quantity == "logit":
        linear = value = float(logits[t.token])
    elif quantity == "contrast":
        linear = value = float(logits[t.token] - logits[FOIL])
    else:  # the linear part of log P_t, z_t − Σ_v P_v z_v, and log P_t itself
        linear = float(logits[t.token] - torch.softmax(logits, -1) @ logits)
        value = float(torch.log_softmax(logits, -1)[t.token])
    assert abs(whole - linear) <= REL_TOL * max(scale, abs(linear))
    assert abs(float(out.values[0]) - value) <= REL_TOL * max(scale, abs(value))


# ---- 3. one layer in closed form ------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_one_layer_closed_form(family):
    """With one layer, flow(p)_j = ρ_p δ_pj + Σ_h α_pj^(h) ⟨b_p^(h), v_j^(g(h))⟩ with
    b_p^(h) = W_O^(h)ᵀ (s_p ⊙ y_p) / ‖y_p‖², and the logit attribution is
    ⟨w, x_p⟩ δ_pj + Σ_h α_pj^(h) ⟨W_O^(h)ᵀ (s_p ⊙ w), v_j⟩ + ⟨w, m_p⟩ flow(p)_j, every
    quantity computed from the weights by hand (llama: o_proj bias; gemma2: post-attention
    norm, attention and final soft-capping, sliding window)."""
    loaded = one_layer_model(family)
    by_hand = one_layer_by_hand(loaded.model, IDS)
    model_logits = loaded.model(input_ids=IDS[None], use_cache=False).logits[0].detach()
    assert torch.allclose(by_hand.logits, model_logits, rtol=0, atol=1e-5)

    p = POSITION
    n_h, n_g, d_h = by_hand.probs.shape[0], by_hand.values.shape[0], by_hand.values.shape[-1]
    y, s = by_hand.y[p], by_hand.scale[p]
    n2 = float(y @ y)
    rho = float(y @ by_hand.x0[p]) / n2

    def through_heads(direction: torch.Tensor) -> torch.Tensor:
        """Σ_h α_p·^(h) ⟨W_O^(h)ᵀ direction, v_·^(g(h))⟩, (T,)."""
        out = torch.zeros(T, dtype=F64)
        for h in range(n_h):
            back = by_hand.w_o[:, h * d_h : (h + 1) * d_h].T @ direction
            out += by_hand.probs[h, p] * (by_hand.values[h // (n_h // n_g)] @ back)
        return out

    flow = through_heads(s * y / n2)
    flow[p] += rho
    beta = float((s * y) @ by_hand.b_o) / n2
    assert math.isclose(float(flow.sum()) + beta, 1.0, rel_tol=1e-12)

    out = library(loaded, target("flow"))
    assert_scores(out.scores[0], flow, f"{family} flow")
    assert abs(float(out.remainder[0]) - beta) <= REL_TOL

    token = 11
    logit_target = targets_for(T, position=p, token=token, quantity="logit")
    out = library(loaded, logit_target)
    cap = loaded.config.final_logit_softcapping if family == "gemma2" else None
    z = float(by_hand.raw_logits[p, token])
    secant = cap * math.tanh(z / cap) / z if cap else 1.0
    w = secant * by_hand.final_scale[p] * loaded.model.lm_head.weight.detach()[token]
    mu = float(w @ by_hand.ffn[p])
    scores = through_heads(s * w) + mu * flow
    scores[p] += float(w @ by_hand.x0[p])
    assert_scores(out.scores[0], scores, f"{family} logit")
    rest = float(w @ (s * by_hand.b_o)) + mu * beta
    assert abs(float(out.remainder[0]) - rest) <= REL_TOL * float(scores.abs().max())
    err = abs(float(out.explained[0]) - float(by_hand.logits[p, token]))
    assert err <= REL_TOL * float(scores.abs().max())


# ---- 4. the baselines -----------------------------------------------------------------------
@pytest.mark.parametrize("weights", ["tiny", "spread"])
@pytest.mark.parametrize("rule", ["rollout", "alti"])
@pytest.mark.parametrize("family", FAMILIES)
def test_baselines_equal_naive(family, rule, weights):
    loaded = model_for(family, weights)
    run = eager_flow_run(loaded.model, IDS)
    out = library(loaded, target("flow"), rule=rule)
    expected = rollout(run, POSITION) if rule == "rollout" else alti(run, POSITION)
    assert_scores(out.scores[0], expected, f"{family} {rule}")
    # rows of ½ ᾱ + ½ I sum to 1 up to the float32 softmax; an ALTI row whose every term
    # points away from y_i (a bias that dominates it) is all zero, and its mass is lost
    rest = 1.0 - float(expected.sum())
    if rule == "rollout":
        assert abs(rest) <= REL_TOL
    assert abs(float(out.remainder[0]) - rest) <= REL_TOL


def test_baselines_refuse_projected_targets():
    loaded = model_for("llama")
    for rule in ("rollout", "alti"):
        with pytest.raises(ValueError, match="pure flow"):
            library(loaded, target("logit"), rule=rule)


# ---- 4b. the direct rule (§7.6): no composition ------------------------------------------
@pytest.mark.parametrize("quantity", ["logit", "logprob", "contrast"])
@pytest.mark.parametrize("family", FAMILIES)
def test_direct_equals_naive(family, quantity):
    """Every update at the target credited to the positions it read, nothing composed: the
    reference's §7.3 sum with every flow F^l replaced by the identity; and, like flow, the
    scores and what the biases receive add up to the explained value."""
    loaded = model_for(family)
    run = eager_flow_run(loaded.model, IDS)
    out = library(loaded, target(quantity), rule="direct")
    t = out.targets[0]
    assert t.token is not None
    expected = target_attribution(run, t.position, t.quantity, t.token, t.foil, composed=False)
    assert_scores(out.scores[0], expected.scores, f"{family} {quantity} direct")
    scale = float(out.scores[0].abs().sum())
    assert abs(float(out.remainder[0]) - expected.bias) <= REL_TOL * scale
    composed = library(loaded, target(quantity))
    assert abs(float(out.explained[0]) - float(composed.explained[0])) <= REL_TOL * scale
    # with more than one layer the composition moves the scores: the two rules differ
    assert float((out.scores[0] - composed.scores[0]).abs().max()) > 1e-3 * scale


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_direct_is_flow_with_one_layer(family):
    """With one layer there is nothing below the target's layer to compose."""
    loaded = one_layer_model(family)
    direct = library(loaded, target("logit"), rule="direct")
    flow = library(loaded, target("logit"))
    assert_scores(direct.scores[0], flow.scores[0].to(F64), f"{family} one layer")


def test_direct_refuses_pure_flow_targets():
    loaded = model_for("llama")
    with pytest.raises(ValueError, match="pure flow target"):
        library(loaded, target("flow"), rule="direct")
    with pytest.raises(ValueError, match="unknown rule"):
        library(loaded, target("logit"), rule="directly")


# ---- 5. several targets at once ------------------------------------------------------------
@pytest.mark.parametrize("quantity", QUANTITIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_continuation_equals_one_at_a_time(family, quantity):
    loaded = model_for(family)
    run = eager_flow_run(loaded.model, IDS)
    tail = [int(i) for i in IDS[-4:]]
    foil = next(f for f in range(99) if f not in tail) if quantity == "contrast" else None
    targets = targets_for(T, continuation=tail, quantity=quantity, foil=foil)
    together = library(loaded, targets)
    width = T - 1  # the last target predicts the last token from position T − 2
    assert together.scores.shape == (4, width)
    for k, t in enumerate(targets):
        assert together.targets[k] == t  # the continuation's tokens, not the top predictions
        w = assert_equals_alone(loaded, together, k, t)
        expected, _ = naive_scores(run, t)
        assert_scores(together.scores[k, :w], expected, f"{family} {quantity} target {k}")


#: joint pass against one target at a time (assert_equals_alone)
JOINT_ATOL = 1e-6


def assert_equals_alone(loaded: LoadedModel, together: FlowOutput, k: int, t: Target) -> int:
    """Target k of a joint pass equals the target alone (scores, values, explained,
    remainder), and scores nothing after its position; returns its width."""
    alone = library(loaded, [t])
    w = t.position + 1
    # not 1e-12: the float64 models' RMS norms (Llama, Gemma) compute in float32, and the two
    # passes' float32 kernels may take different vectorised paths (seen on an AMD EPYC:
    # 7e-9); a wrong joint pass is off by orders of magnitude more
    assert torch.allclose(together.scores[k, :w], alone.scores[0], rtol=0, atol=JOINT_ATOL)
    assert not bool(together.scores[k, w:].any())
    for name in ("values", "explained", "remainder"):
        a, b = getattr(together, name)[k], getattr(alone, name)[0]
        assert torch.allclose(a, b, rtol=0, atol=JOINT_ATOL, equal_nan=True), name
    return w


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2"])
def test_mixed_targets_equal_one_at_a_time(family):
    """Targets of different quantities and positions in one pass (flow rows start at their
    position, projected ones accumulate g^l): each equals its own pass."""
    loaded = model_for(family)
    targets = [
        Target(3, quantity="flow"),
        Target(8, token=17, quantity="logit"),
        Target(5, token=2, quantity="contrast", foil=40),
        Target(8, quantity="logprob"),
    ]
    together = library(loaded, targets)
    assert together.scores.shape == (4, 9)
    for k, t in enumerate(together.targets):
        assert_equals_alone(loaded, together, k, t)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2"])
def test_first_and_last_position(family):
    """Targets at position 0 (scores of width 1) and at the last position (width T)."""
    loaded = model_for(family)
    run = eager_flow_run(loaded.model, IDS)
    for position in (0, T - 1):
        for quantity in ("flow", "logprob"):
            out = library(loaded, target(quantity, position))
            assert out.scores.shape == (1, position + 1)
            expected, _ = naive_scores(run, out.targets[0])
            assert_scores(out.scores[0], expected, f"{family} {quantity} at {position}")


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_neox"])
def test_layer_breakdown_sums_to_the_attribution(family):
    """Splitting the flow by the layer its terms come from loses nothing."""
    from contribution_weights.attribution.flow import layer_breakdown

    model = tiny_model(family, dtype=torch.float64)
    ids = torch.randint(3, 90, (10,))
    targets = targets_for(10, position=7, quantity="logit")
    fwd, targets = forward_factors(model, ids, targets, dtype=torch.float64)
    out = propagate(model, fwd, targets)
    parts = layer_breakdown(model, fwd, targets, 0)
    assert parts.shape == (2 * len(fwd.layers) + 1, 8)
    torch.testing.assert_close(parts.sum(0), out.scores[0], atol=1e-10, rtol=1e-10)
    assert parts[-1].count_nonzero() == 1  # the embedding's term sits at the target


# ---- 7. whole-text token scores (the removal sweeps' end-to-end rankings) --------------------
@pytest.mark.parametrize("limit", [None, 6])
@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2"])
def test_token_flow_scores_are_the_mean_of_every_later_positions_flow(family, limit):
    """s_j = mean over positions j ≤ i < limit of position i's pure flow on token j, each
    row built by the naive reference (flow, rollout, ALTI); positions ≥ limit score 0."""
    from contribution_weights.attribution.flow import token_flow_scores

    loaded = model_for(family)
    run = eager_flow_run(loaded.model, IDS)
    stop = T if limit is None else limit
    got = token_flow_scores(loaded, IDS, RULES, limit=limit, dtype=F64)
    naive = {"flow": pure_flow, "rollout": rollout, "alti": alti}
    for rule in RULES:
        rows = torch.zeros(stop, T, dtype=F64)
        for i in range(stop):
            rows[i] = naive[rule](run, i)
        expected = torch.zeros(T, dtype=F64)
        expected[:stop] = rows.sum(0)[:stop] / torch.arange(stop, 0, -1, dtype=F64)
        assert got[rule].shape == (T,)
        assert_scores(got[rule], expected, f"{family} {rule} limit={limit}")
    with pytest.raises(ValueError, match="unknown mixing rule"):
        token_flow_scores(loaded, IDS, ["attention"])
