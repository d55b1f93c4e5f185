"""Value zeroing (method §7.5) against a naive float64 computation.

The library re-runs each decoder layer alone on a batch of copies of its recorded input,
token j's values zeroed in copy j through the capture intervention. The naive side runs the
WHOLE model once per (layer l, token j) on its own eager attention, token j's value
zeroed at layer l only (a plain forward hook on ``v_proj`` where the family has one; the
capture intervention, batch of one, for GPT-2's fused ``c_attn`` and GPT-NeoX's
``query_key_value``), reads layer l's output with a forward hook, and takes
``1 − cos`` directly. The composed attribution is checked against explicit matrix products.

Tolerance: both sides are float64 models on eager attention (every family but GPT-2
takes its softmax in float32 on both sides alike); they agree to 2e-14 on these models.
``TOL = 1e-10`` is far below a real mistake (a token, a layer or a head misplaced moves
entries by 1e-2 or more). In Gemma's sliding-window layers the tokens outside a query's
window get exactly 0 on both sides.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from tiny_models import tiny_model
from torch import Tensor

import contribution_weights as cw
from contribution_weights import LoadedModel
from contribution_weights.attribution.value_zeroing import ValueZeroing, value_zeroing
from contribution_weights.capture import AttentionEdit, capturing

F64 = torch.float64
TOL = 1e-10
#: composed rows against the naive matrix products (test_composition_equals_matrix_products)
COMPOSED_TOL = 1e-6
T = 9
POSITION = 6
IDS = torch.randint(0, 99, (T,), generator=torch.Generator().manual_seed(5))
FAMILIES = ["llama", "qwen2", "gemma2", "gemma3_text", "gpt2", "gpt_neox"]


def model_for(family: str) -> LoadedModel:
    """Weights of standard deviation 0.3: peaked attention, attention updates as large as
    the residual stream (the default 0.02 leaves α nearly uniform)."""
    loaded = tiny_model(family, dtype=F64)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in loaded.model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=F64)
            if param.dim() >= 2:
                param.copy_(0.3 * noise)
            elif name.endswith("weight"):
                param.add_(0.2 * noise)
    loaded.model.set_attn_implementation("eager")
    return loaded


def _layers(model: Any) -> list[Any]:
    kind = model.config.model_type
    if kind == "gpt2":
        return list(model.transformer.h)
    if kind == "gpt_neox":
        return list(model.gpt_neox.layers)
    return list(model.model.layers)


class _ZeroOne:
    def __init__(self, layer: int, token: int) -> None:
        self.layer, self.token = layer, token

    def edit(self, call: Any) -> AttentionEdit | None:
        if call.layer_idx != self.layer:
            return None
        scale = torch.ones(1, call.num_heads, call.k_len, dtype=call.value.dtype)
        scale[:, :, self.token] = 0.0
        return AttentionEdit(scale=scale)


@contextmanager
def _zeroed(loaded: LoadedModel, layer: int, token: int) -> Iterator[None]:
    """Token ``token``'s values zeroed at layer ``layer`` only, for one whole forward."""
    attn = _layers(loaded.model)[layer]
    v_proj = getattr(getattr(attn, "self_attn", None), "v_proj", None)
    if v_proj is None:  # fused q/k/v projections: through the capture intervention
        with capturing(loaded.model, intervention=_ZeroOne(layer, token)):
            yield
        return

    def hook(module: Any, args: Any, out: Tensor) -> Tensor:
        out = out.clone()
        out[:, token] = 0.0
        return out

    handle = v_proj.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _layer_output(loaded: LoadedModel, ids: Tensor, layer: int) -> Tensor:
    kept: list[Tensor] = []

    def hook(module: Any, args: Any, out: Any) -> None:
        kept.append((out if isinstance(out, Tensor) else out[0]).detach()[0])

    handle = _layers(loaded.model)[layer].register_forward_hook(hook)
    try:
        with torch.no_grad():
            loaded.model(input_ids=ids[None], use_cache=False)
    finally:
        handle.remove()
    return kept[0]


def naive_matrices(loaded: LoadedModel, ids: Tensor) -> list[Tensor]:
    """Each layer's ``C^l`` from T × L whole forwards."""
    out = []
    n = ids.numel()
    for layer in range(len(_layers(loaded.model))):
        original = _layer_output(loaded, ids, layer)
        dist = torch.zeros(n, n, dtype=F64)
        for j in range(n):
            with _zeroed(loaded, layer, j):
                altered = _layer_output(loaded, ids, layer)
            cos = torch.nn.functional.cosine_similarity(altered, original, dim=-1)
            dist[:, j] = 1.0 - cos
        dist = torch.tril(dist)
        out.append(dist / dist.sum(-1, keepdim=True))
    return out


_NAIVE: dict[str, list[Tensor]] = {}


def naive(family: str, loaded: LoadedModel) -> list[Tensor]:
    if family not in _NAIVE:
        _NAIVE[family] = naive_matrices(loaded, IDS)
    return _NAIVE[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_matrices_equal_naive(family):
    loaded = model_for(family)
    expected = naive(family, loaded)
    vz = ValueZeroing(loaded, IDS, copies=4)  # chunks of 4, 4 and 1 copies
    for layer, want in enumerate(expected):
        got = vz.matrix(layer)
        assert torch.allclose(got, want, atol=TOL, rtol=0), (
            f"{family} layer {layer}: max diff {float((got - want).abs().max()):.3g}"
        )
        assert torch.allclose(got.sum(-1), torch.ones(T, dtype=F64), atol=1e-12)
        assert bool((torch.triu(got, 1) == 0).all())
        assert bool((got.diagonal() > 0).all())
    # one batch of every copy gives the same matrices
    whole = ValueZeroing(loaded, IDS)
    assert torch.allclose(whole.matrix(0), vz.matrix(0), atol=1e-12, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_composition_equals_matrix_products(family):
    loaded = model_for(family)
    mats = naive(family, loaded)
    positions = torch.tensor([POSITION, 3])
    product = torch.linalg.multi_dot(mats[::-1]) if len(mats) > 1 else mats[0]
    got = value_zeroing(loaded, IDS, positions, dtype=F64, copies=5)
    # only the tokens up to the last target were run: width POSITION + 1
    assert got.shape == (2, POSITION + 1)
    for k, p in enumerate(positions.tolist()):
        want = product[p, : POSITION + 1]
        # COMPOSED_TOL, not TOL: the composed rows (copies batched) against the naive
        # per-token products differ by up to 1e-7 on some CPUs (an AMD EPYC), where the
        # float64 models' float32 internals (RMS norms, rotary tables) take shape-dependent
        # kernel paths; a wrong composition is off by far more
        assert torch.allclose(got[k], want, atol=COMPOSED_TOL, rtol=0), (
            f"{family} position {p}: max diff {float((got[k] - want).abs().max()):.3g}"
        )
        assert abs(float(got[k].sum()) - 1.0) < 1e-12
        assert bool((got[k, p + 1 :] == 0).all())


def test_attribute_api():
    loaded = model_for("llama")
    a = cw.attribute(loaded, IDS, methods="value_zeroing,rollout", position=POSITION)
    scores = a["value_zeroing"]
    assert scores.shape == (1, T)
    assert bool((scores[0, POSITION + 1 :] == 0).all())
    assert abs(float(scores[0].sum()) - 1.0) < 1e-6
    assert abs(a.remainder["value_zeroing"][0]) < 1e-6
    product = torch.linalg.multi_dot(naive("llama", loaded)[::-1])
    assert torch.allclose(scores[0], product[POSITION], atol=1e-6, rtol=0)
    # a pure flow: the target's token and quantity do not change it
    b = cw.attribute(loaded, IDS, methods="value_zeroing", position=POSITION, quantity="flow")
    assert torch.equal(b["value_zeroing"], scores)
