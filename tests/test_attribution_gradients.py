"""Gradient and ablation baselines (attribution/gradients.py) on tiny float64 models.

Each method is checked twice: against captum called directly here (a different captum
entry point where one exists, written independently of the module), and against a
computation that does not use captum at all (autograd, the completeness axiom, zeroing
loops). Values are read from the full logits by hand, not through ``target_values``.
"""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path

import pytest
import torch
from captum.attr import (
    FeatureAblation,
    IntegratedGradients,
    LayerGradientXActivation,
)

from contribution_weights import LoadedModel
from contribution_weights.attribution.gradients import (
    feature_ablation,
    input_x_gradient,
    integrated_gradients,
)
from contribution_weights.attribution.targets import Target, TargetError, resolve, targets_for

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import tiny_model

FAMILIES = ["llama", "gemma2", "gpt2"]  # plain, soft-capped (and √d-scaled), Conv1D + wpe
T = 9
METHODS = [integrated_gradients, input_x_gradient, feature_ablation]


@cache
def model_of(family: str) -> LoadedModel:
    return tiny_model(family, dtype=torch.float64)


def ids_of(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 99, (T,), generator=torch.Generator().manual_seed(seed))


def targets_of(model: LoadedModel, ids: torch.Tensor) -> list[Target]:
    """One of each quantity (the logprob of the top prediction) and a continuation."""
    raw = [Target(T - 1), Target(4, 7, "logit"), Target(6, 3, "contrast", foil=11)]
    raw += targets_for(T, continuation=ids[-3:].tolist())
    with torch.no_grad():
        logits = model.model(input_ids=ids[None], use_cache=False).logits[0]
    return resolve(raw, logits[[t.position for t in raw]])


def read(logits: torch.Tensor, t: Target) -> torch.Tensor:
    """(B,): the target's value from full (B, T, V) logits, written out per quantity."""
    row = logits[:, t.position]
    if t.quantity == "logprob":
        return row.log_softmax(-1)[:, t.token]
    if t.quantity == "logit":
        return row[:, t.token]
    assert t.quantity == "contrast"
    return row[:, t.token] - row[:, t.foil]


def hand_value(model: LoadedModel, embeds: torch.Tensor, t: Target) -> torch.Tensor:
    return read(model.model(inputs_embeds=embeds, use_cache=False).logits, t)


def embeds_of(model: LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.model.get_input_embeddings()(ids[None])


@pytest.fixture(params=FAMILIES)
def case(request: pytest.FixtureRequest) -> tuple[LoadedModel, torch.Tensor, list[Target]]:
    model = model_of(request.param)
    ids = ids_of()
    return model, ids, targets_of(model, ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_inputs_embeds_path_is_the_input_ids_path(family: str) -> None:
    """The methods feed ``inputs_embeds``: it must be the model's own computation (Gemma's
    √d scale included)."""
    model, ids = model_of(family), ids_of()
    with torch.no_grad():
        a = model.model(input_ids=ids[None], use_cache=False).logits
        b = model.model(inputs_embeds=embeds_of(model, ids), use_cache=False).logits
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_integrated_gradients(case: tuple[LoadedModel, torch.Tensor, list[Target]]) -> None:
    model, ids, targets = case
    scores = integrated_gradients(model, ids, targets, steps=64)
    assert scores.shape == (len(targets), T) and scores.dtype == torch.float64
    embeds = embeds_of(model, ids)
    zero = torch.zeros_like(embeds)
    for k, t in enumerate(targets):
        # captum directly: plain IG on inputs_embeds from the zero embeddings
        ig = IntegratedGradients(lambda e, t=t: hand_value(model, e, t))
        attr, delta = ig.attribute(
            embeds, baselines=zero, n_steps=64, return_convergence_delta=True
        )
        torch.testing.assert_close(scores[k], attr[0].sum(-1), rtol=1e-7, atol=1e-9)
        # completeness, without captum: the scores sum to f(x) − f(0), up to captum's delta
        with torch.no_grad():
            gap = hand_value(model, embeds, t) - hand_value(model, zero, t)
        assert abs(float(scores[k].sum() - gap - delta)) < 1e-7
        if model.config.model_type != "gemma2":  # see test_gemma2_zero_baseline_is_singular
            assert abs(float(delta)) < 1e-6
            assert abs(float(scores[k].sum() - gap)) < 1e-6
        # causal: tokens after the position get nothing
        assert bool((scores[k, t.position + 1 :].abs() < 1e-12).all())


def test_integrated_gradients_batched_and_coarse() -> None:
    """internal_batch_size only changes how the steps are batched; few steps still keep
    completeness roughly (Gauss-Legendre), and more steps tighten it."""
    model, ids = model_of("llama"), ids_of(2)
    targets = targets_of(model, ids)[:1]
    full = integrated_gradients(model, ids, targets, steps=20)
    chunked = integrated_gradients(model, ids, targets, steps=20, internal_batch_size=7)
    torch.testing.assert_close(full, chunked, rtol=1e-10, atol=1e-12)
    embeds = embeds_of(model, ids)
    with torch.no_grad():
        gap = hand_value(model, embeds, targets[0]) - hand_value(
            model, torch.zeros_like(embeds), targets[0]
        )
    err = [
        abs(float(integrated_gradients(model, ids, targets, steps=s).sum() - gap)) for s in (2, 50)
    ]
    assert err[1] < 1e-6 < err[0]


def test_gemma2_zero_baseline_is_singular() -> None:
    """Why completeness is not asserted for Gemma 2: its norms after each block (sandwich
    norms) scale a residual far below √eps up by 1/√eps each, so f(αE) still moves by
    O(0.1) between α = 1e-12 and α = 0, a jump no quadrature of the path resolves. In
    Llama (pre-norms only) f(αE) tends to f(0) smoothly."""
    t = Target(T - 1, 5, "logit")
    jumps = {}
    for family in ("gemma2", "llama"):
        model, ids = model_of(family), ids_of()
        embeds = embeds_of(model, ids)
        with torch.no_grad():
            near, at = hand_value(model, torch.cat([1e-12 * embeds, 0 * embeds]), t)
        jumps[family] = abs(float(near - at))
    assert jumps["gemma2"] > 1e-2 and jumps["llama"] < 1e-9


def test_input_x_gradient(case: tuple[LoadedModel, torch.Tensor, list[Target]]) -> None:
    model, ids, targets = case
    scores = input_x_gradient(model, ids, targets)
    assert scores.shape == (len(targets), T)
    embeds = embeds_of(model, ids)
    for k, t in enumerate(targets):
        # autograd by hand
        e = embeds.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(hand_value(model, e, t).sum(), e)
        torch.testing.assert_close(scores[k], (grad * embeds)[0].sum(-1), rtol=1e-9, atol=1e-12)

        # captum directly, through another entry point: the embedding layer's output
        # times its gradient, the model run from input ids
        def from_ids(tokens: torch.Tensor, t: Target = t) -> torch.Tensor:
            return read(model.model(input_ids=tokens, use_cache=False).logits, t)

        layer = model.model.get_input_embeddings()
        attr = LayerGradientXActivation(from_ids, layer).attribute(ids[None])
        torch.testing.assert_close(scores[k], attr[0].sum(-1), rtol=1e-9, atol=1e-12)


def test_feature_ablation(case: tuple[LoadedModel, torch.Tensor, list[Target]]) -> None:
    model, ids, targets = case
    scores = feature_ablation(model, ids, targets)
    assert scores.shape == (len(targets), T)
    embeds = embeds_of(model, ids)
    for k, t in enumerate(targets):
        # zeroing loop by hand, over every token (later ones included)
        with torch.no_grad():
            base = hand_value(model, embeds, t)
            expected = torch.zeros(T, dtype=torch.float64)
            for j in range(T):
                ablated = embeds.clone()
                ablated[:, j] = 0
                expected[j] = (base - hand_value(model, ablated, t))[0]
        torch.testing.assert_close(scores[k], expected, rtol=1e-9, atol=1e-12)
        # captum directly: every token a feature, one ablation per forward
        ablation = FeatureAblation(lambda e, t=t: hand_value(model, e, t))
        attr = ablation.attribute(
            embeds, baselines=0.0, feature_mask=torch.arange(T)[None, :, None]
        )
        torch.testing.assert_close(scores[k], attr[0, :, 0], rtol=1e-9, atol=1e-12)


def test_feature_ablation_batches_its_forwards() -> None:
    """Per target: one forward of the input and the ablations of tokens 0..p in batches,
    each forward with logits_to_keep = T − p and no cache."""
    model, ids = model_of("llama"), ids_of()
    targets = targets_of(model, ids)
    calls: list[tuple[int, dict]] = []

    def spy(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        calls.append((kwargs["inputs_embeds"].shape[0], dict(kwargs)))

    handle = model.model.register_forward_pre_hook(spy, with_kwargs=True)
    try:
        batched = feature_ablation(model, ids, targets)
        assert len(calls) == 2 * len(targets)  # the input, then every ablation at once
        assert [b for b, _ in calls[:2]] == [1, targets[0].position + 1]
        for (_, kwargs), t in zip(calls[::2], targets, strict=True):
            assert kwargs["logits_to_keep"] == T - t.position and kwargs["use_cache"] is False
        calls.clear()
        one_by_one = feature_ablation(model, ids, targets, perturbations_per_eval=1)
        assert len(calls) == sum(t.position + 2 for t in targets)
    finally:
        handle.remove()
    torch.testing.assert_close(batched, one_by_one, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.__name__)
def test_gradient_methods_use_logits_to_keep(method) -> None:
    model, ids = model_of("gpt2"), ids_of()
    target = targets_of(model, ids)[1]
    seen: list[dict] = []
    handle = model.model.register_forward_pre_hook(
        lambda m, a, kw: seen.append(dict(kw)), with_kwargs=True
    )
    try:
        method(model, ids, [target])
    finally:
        handle.remove()
    assert seen and all(kw["logits_to_keep"] == T - target.position for kw in seen)
    assert all(kw["use_cache"] is False for kw in seen)


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.__name__)
def test_no_state_leaks(method) -> None:
    """No .grad on the parameters; the train flag comes back; dropout is off meanwhile;
    the scores carry no graph."""
    model, ids = model_of("gpt2"), ids_of()
    targets = targets_of(model, ids)[:2]
    expected = method(model, ids, targets)
    model.model.train()
    try:
        again = method(model, ids, targets)
        assert model.model.training
    finally:
        model.model.eval()
    torch.testing.assert_close(again, expected, rtol=0, atol=0)
    assert all(p.grad is None for p in model.model.parameters())
    assert not expected.requires_grad
    with torch.no_grad():  # a caller's no_grad does not stop the gradient methods
        torch.testing.assert_close(method(model, ids, targets), expected, rtol=0, atol=0)


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.__name__)
def test_refuses_flow_and_unresolved_targets(method) -> None:
    model, ids = model_of("llama"), ids_of()
    with pytest.raises(TargetError, match="flow"):
        method(model, ids, [Target(3, 5, "flow")])
    with pytest.raises(TargetError, match="resolve"):
        method(model, ids, [Target(3)])
    with pytest.raises(TargetError, match="out of range"):
        method(model, ids, [Target(T, 5)])
    assert method(model, ids, []).shape == (0, T)
