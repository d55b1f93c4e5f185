"""The pure maths of :mod:`contribution_weights.measures.layer` against the float64 reference.

No model here: :class:`LayerTensors` is fed random probabilities, values and output
projections over random shapes (hypothesis), plus a few hand-computed cases, and compared
with :func:`reference.reference_layer`, which materialises every ṽ_j^(h).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from reference import reference_layer, scalar_contribution

from contribution_weights.measures import (
    LayerTensors,
    entropy,
    get_measure,
    measure_names,
    resolve_measures,
    split_output_weight,
    token_scores,
)
from contribution_weights.measures.distance import distance

F64 = torch.float64
NAMES = ["attention", "contribution", "intra", "relative_norm", "cosine", "vw", "vw_on"]
NAMES += ["distance", "ihc"]


def close_rel(
    actual: torch.Tensor,
    expected: torch.Tensor,
    rtol: float | torch.Tensor,
    what: str,
    floor: float = 0.01,
) -> None:
    """|a − e| ≤ rtol·(|e| + floor·max|e|), and a finite (``rtol`` may vary by entry)."""
    assert torch.isfinite(actual).all(), f"{what}: non-finite"
    scale = expected.abs().max().item() if expected.numel() else 0.0
    err = (actual.to(F64) - expected).abs()
    tol = rtol * (expected.abs() + floor * scale) + 1e-300
    assert (err <= tol).all(), f"{what}: max error {err.max().item():.3g}, scale {scale:.3g}"


def make_layer(
    seed: int,
    batch: int,
    kv_heads: int,
    group: int,
    keys: int,
    queries: int,
    head_dim: int,
    dim: int,
    bias: bool,
    case: str,
    dtype: torch.dtype = F64,
) -> tuple[LayerTensors, dict[str, torch.Tensor]]:
    """A random layer: the last ``queries`` rows of a causal ``keys × keys`` attention.

    ``case``: ``"plain"``, ``"zero_w"`` (W_O = 0), ``"zero_v"`` (all values 0),
    ``"zero_cols"`` (some attention columns removed as an intervention does, method §4).
    """
    gen = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    pos = torch.arange(keys - queries, keys)
    valid = (torch.arange(keys)[None, :] <= pos[:, None]).expand(batch, queries, keys)
    scores = torch.randn(batch, heads, queries, keys, generator=gen, dtype=F64) * 2
    scores = scores.masked_fill(~valid[:, None], float("-inf"))
    probs = scores.softmax(-1)
    values = torch.randn(batch, kv_heads, keys, head_dim, generator=gen, dtype=F64)
    weight = torch.randn(dim, heads * head_dim, generator=gen, dtype=F64)
    b_o = torch.randn(dim, generator=gen, dtype=F64) if bias else None
    if case == "zero_w":
        weight.zero_()
    elif case == "zero_v":
        values.zero_()
    elif case == "zero_cols":
        keep = torch.rand(batch, heads, 1, keys, generator=gen) < 0.5
        probs = probs * keep
    probs, values, weight = probs.to(dtype), values.to(dtype), weight.to(dtype)
    b_o = None if b_o is None else b_o.to(dtype)
    lt = LayerTensors(probs, values, split_output_weight(weight, heads), b_o, valid)
    return lt, {"probs": probs, "values": values, "weight": weight, "valid": valid, "bias": b_o}


def projection_conditioning(w_o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``(H, N)``: (‖W_O^(h)‖₂ ‖x_n‖ / ‖W_O^(h) x_n‖)² for ``x`` ``(H, N, d_h)``, at least 1
    (1 where W_O^(h) x_n = 0).

    The library takes ‖W_O^(h) x‖ by the Gram form sqrt(x Gram xᵀ), without building
    W_O^(h) x; that loses about eps·(this factor) relative precision when the projection
    nearly cancels. The property test found it twice in float64: in č, whose ‖o_i^(h)‖²
    (x = z_i^(h), a head output of 9e-6 against inputs of order 1) put it off by 1e-8
    relative, and in the cosine of a one-dimensional model (x = v_j, 2e-8 relative).
    """
    exact = torch.einsum("hnd,hed->hne", x, w_o).norm(dim=-1)
    bound = torch.linalg.matrix_norm(w_o, ord=2)[:, None] * x.norm(dim=-1)
    return torch.where(exact > 0, bound / exact, torch.ones_like(exact)).square().clamp_min(1)


def head_conditioning(lt: LayerTensors, b: int) -> torch.Tensor:
    """``(H, I, 1)``: :func:`projection_conditioning` of the head states z_i^(h) (for č)."""
    return projection_conditioning(lt.w_o, lt.head_states[b])[..., None]


def value_conditioning(lt: LayerTensors, b: int) -> torch.Tensor:
    """``(H, 1, T)``: :func:`projection_conditioning` of the values v_j (for ‖ṽ_j^(h)‖)."""
    return projection_conditioning(lt.w_o, lt.head_values[b])[:, None, :]


VALUE_NORM_MEASURES = ("relative_norm", "cosine", "vw", "vw_on")  # ‖ṽ_j‖ by the Gram form


def check_against_reference(
    lt: LayerTensors,
    raw: dict[str, torch.Tensor],
    rtol: float,
    well_conditioned_distance: bool = False,
) -> None:
    for b in range(raw["probs"].shape[0]):
        ref = reference_layer(
            raw["probs"][b], raw["values"][b], raw["weight"], raw["bias"], raw["valid"][b]
        )
        for name in NAMES:
            got = get_measure(name).compute(lt)[b]
            if name == "distance" and well_conditioned_distance:
                # Normalising D divides by its total; where that total is a rounding-level
                # fraction of ‖o‖₁, float32 D is arbitrary (all terms clamp to ~0).
                rows = ref["distance_total"] > 1e-2 * ref["output_l1"]
                close_rel(got[:, rows], ref[name][:, rows], rtol, name, 1.0)
                continue
            if name == "intra":
                close_rel(got, ref[name], rtol * head_conditioning(lt, b), name)
                continue
            if name in VALUE_NORM_MEASURES:
                close_rel(got, ref[name], rtol * value_conditioning(lt, b), name)
                continue
            close_rel(got, ref[name], rtol, name)
        close_rel(lt.output[b], ref["output"], rtol, "output")
        close_rel(lt.head_outputs[b], ref["head_outputs"], rtol, "head_outputs")
        close_rel(lt.bias_share[b], ref["bias_share"], rtol, "bias_share")
        assert torch.equal(lt.degenerate[b], ref["degenerate"])


layer_shapes = st.fixed_dictionaries(
    {
        "seed": st.integers(0, 2**31 - 1),
        "batch": st.integers(1, 3),
        "kv_heads": st.integers(1, 3),
        "group": st.integers(1, 3),
        "keys": st.integers(1, 8),
        "head_dim": st.integers(1, 5),
        "dim": st.integers(1, 9),
        "bias": st.booleans(),
        "case": st.sampled_from(["plain", "plain", "zero_w", "zero_v", "zero_cols"]),
    }
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=layer_shapes, data=st.data())
def test_layer_tensors_match_reference(shape, data):
    queries = data.draw(st.integers(1, shape["keys"]), label="queries")
    lt, raw = make_layer(queries=queries, **shape)
    check_against_reference(lt, raw, rtol=1e-9)


def test_intra_of_a_head_whose_output_nearly_cancels_is_checked_to_its_conditioning():
    # found by the property test above (a fresh clone's random search): head output 9e-6
    shape = dict(seed=2, batch=3, kv_heads=1, group=1, keys=8, head_dim=2, dim=1, bias=False)
    lt, raw = make_layer(queries=5, case="plain", **shape)
    ref = reference_layer(
        raw["probs"][2], raw["values"][2], raw["weight"], raw["bias"], raw["valid"][2]
    )
    assert head_conditioning(lt, 2).max() > 1e8  # the ill-conditioned head the rounding comes from
    with pytest.raises(AssertionError, match="intra"):
        close_rel(get_measure("intra").compute(lt)[2], ref["intra"], 1e-9, "intra")
    check_against_reference(lt, raw, rtol=1e-9)


def test_cosine_of_a_value_the_projection_nearly_annihilates_is_checked_to_its_conditioning():
    # found by the property test above (a longer random search): dim = 1, W_O v_j ≈ 0
    shape = dict(seed=10499225, batch=3, kv_heads=2, group=2, keys=7, head_dim=4, dim=1)
    lt, raw = make_layer(queries=5, case="plain", bias=False, **shape)
    assert value_conditioning(lt, 1).max() > 1e9  # the ill-conditioned value
    ref = reference_layer(
        raw["probs"][1], raw["values"][1], raw["weight"], raw["bias"], raw["valid"][1]
    )
    with pytest.raises(AssertionError, match="cosine"):
        close_rel(get_measure("cosine").compute(lt)[1], ref["cosine"], 1e-9, "cosine")
    check_against_reference(lt, raw, rtol=1e-9)


def test_distance_of_rounding_noise_is_zero_not_uniform_over_heads():
    # found by the property test above: with W_O = 0 every head's D is ~1 ulp of noise
    # (‖o‖₁ and ‖o − 0‖₁ summed in different orders), and normalising it gave each head 1/H
    shape = dict(seed=0, batch=1, kv_heads=3, group=1, keys=1, head_dim=1, dim=7, bias=True)
    lt, raw = make_layer(queries=1, case="zero_w", **shape)
    assert torch.equal(get_measure("distance").compute(lt), torch.zeros_like(lt.probs))
    check_against_reference(lt, raw, rtol=1e-9)


@settings(max_examples=30, deadline=None)
@given(shape=layer_shapes)
def test_layer_tensors_float32_close_to_reference(shape):
    # Realistic shapes only (model dim ≥ 2 × head dim, as in every real model): with d < d_h a
    # value can be nearly orthogonal to W_O^(h)'s rows, and the Gram form of ‖ṽ‖ then keeps
    # only half of float32's digits (absolute error ~ sqrt(eps)·‖W_O^(h)‖·‖v‖).
    assume(shape["dim"] >= 2 * shape["head_dim"])
    lt, raw = make_layer(queries=shape["keys"], dtype=torch.float32, **shape)
    assert lt.output.dtype == torch.float32
    # float32 inputs, float64 reference maths: only the float32 rounding differs
    raw = {k: (v.to(F64) if v is not None and v.is_floating_point() else v) for k, v in raw.items()}
    # D = max(0, ‖o‖₁ − ‖o − αṽ‖₁) cancels: in float32 it is checked relative to its scale,
    # on rows whose total is not itself rounding noise.
    check_against_reference(lt, raw, rtol=2e-3, well_conditioned_distance=True)


@settings(max_examples=40, deadline=None)
@given(shape=layer_shapes)
def test_sums_and_identity(shape):
    lt, _ = make_layer(queries=shape["keys"], **shape)
    a, c = lt.probs, get_measure("contribution").compute(lt)
    r, k = get_measure("relative_norm").compute(lt), get_measure("cosine").compute(lt)
    torch.testing.assert_close(c, a * r * k, rtol=1e-9, atol=1e-12)
    ok = ~lt.degenerate
    torch.testing.assert_close(c.sum(dim=(1, 3))[ok], (1 - lt.bias_share)[ok])
    assert (c.sum(dim=(1, 3))[~ok] == 0).all()
    intra_sum = get_measure("intra").compute(lt).sum(-1)  # (B, H, I)
    has_output = lt.head_output_norm2 > 0
    torch.testing.assert_close(intra_sum[has_output], torch.ones_like(intra_sum[has_output]))
    assert (intra_sum[~has_output] == 0).all()
    d_sum = get_measure("distance").compute(lt).sum(dim=(1, 3))
    assert ((d_sum - 1).abs() < 1e-9).logical_or(d_sum == 0).all()


@settings(max_examples=25, deadline=None)
@given(shape=layer_shapes, max_elements=st.integers(1, 200))
def test_distance_chunks_agree(shape, max_elements):
    lt, _ = make_layer(queries=shape["keys"], **shape)
    torch.testing.assert_close(
        distance(lt, max_elements=max_elements), distance(lt), rtol=0, atol=0
    )


def test_reference_against_scalar_loops():
    """The reference itself, against Python-float loops over every (h, i, j)."""
    _, raw = make_layer(3, 1, 2, 2, 5, 5, 3, 6, True, "plain")
    probs, values, weight, bias = raw["probs"][0], raw["values"][0], raw["weight"], raw["bias"]
    ref = reference_layer(probs, values, weight, bias, raw["valid"][0])
    for h in range(4):
        for i in range(5):
            for j in range(5):
                expected = scalar_contribution(probs, values, weight, bias, h, i, j)
                assert ref["contribution"][h, i, j].item() == pytest.approx(expected, abs=1e-12)


def test_hand_computed_example():
    """One head, d = d_h = 1, W_O = 1, v = (1, −2); query 1 attends (½, ½): o_1 = −½."""
    probs = torch.tensor([[[[1.0, 0.0], [0.5, 0.5]]]], dtype=F64)
    values = torch.tensor([[[[1.0], [-2.0]]]], dtype=F64)
    w_o = torch.ones(1, 1, 1, dtype=F64)
    valid = torch.tensor([[[True, False], [True, True]]])
    lt = LayerTensors(probs, values, w_o, None, valid)
    expected = {
        "contribution": [[1.0, 0.0], [-1.0, 2.0]],
        "intra": [[1.0, 0.0], [-1.0, 2.0]],
        "relative_norm": [[1.0, 0.0], [2.0, 4.0]],
        "cosine": [[1.0, 0.0], [-1.0, 1.0]],
        "vw": [[1.0, 0.0], [0.5, 1.0]],
        "vw_on": [[1.0, 0.0], [1.0, 2.0]],
        # row 1: ‖o‖₁ = ½, ‖o − α_10 ṽ_0‖₁ = 1, ‖o − α_11 ṽ_1‖₁ = ½: both clamp to 0
        "distance": [[1.0, 0.0], [0.0, 0.0]],
    }
    ref = reference_layer(probs[0], values[0], w_o[0], None, valid[0])
    for name, table in expected.items():
        want = torch.tensor([table], dtype=F64)
        torch.testing.assert_close(get_measure(name).compute(lt)[0], want, msg=name)
        torch.testing.assert_close(ref[name], want, msg=f"reference {name}")


def test_gqa_heads_read_their_kv_group():
    """Query head h reads KV head h // (H/G), as transformers' repeat_kv does."""
    values = torch.arange(2 * 1 * 1, dtype=F64).reshape(1, 2, 1, 1) + 1  # KV heads: 1, 2
    probs = torch.ones(1, 4, 1, 1, dtype=F64)
    w_o = torch.ones(4, 1, 1, dtype=F64)
    lt = LayerTensors(probs, values, w_o, None, torch.ones(1, 1, 1, dtype=torch.bool))
    assert lt.head_values[0, :, 0, 0].tolist() == [1.0, 1.0, 2.0, 2.0]
    assert lt.value_norm[0, :, 0].tolist() == [1.0, 1.0, 2.0, 2.0]


def test_split_output_weight_takes_column_blocks():
    weight = torch.arange(2 * 6, dtype=F64).reshape(2, 6)  # d = 2, H = 3, d_h = 2
    blocks = split_output_weight(weight, 3)
    for h in range(3):
        assert torch.equal(blocks[h], weight[:, 2 * h : 2 * h + 2])
    with pytest.raises(ValueError, match="multiple of 4 heads"):
        split_output_weight(weight, 4)


def test_layer_tensors_reject_mismatched_shapes():
    lt, raw = make_layer(0, 1, 2, 2, 4, 4, 3, 5, False, "plain")
    with pytest.raises(ValueError, match="do not divide"):
        LayerTensors(raw["probs"], raw["values"][:, :1].repeat(1, 3, 1, 1), lt.w_o, None, lt.valid)
    # jaxtyping (TypeError, under pytest) or the constructor's own check (ValueError)
    with pytest.raises((ValueError, TypeError), match=r"shape mismatch|Type-check error"):
        LayerTensors(raw["probs"], raw["values"][:, :, :3], lt.w_o, None, lt.valid)


def test_shapes_in_signatures_are_checked_under_pytest():
    """tests/conftest.py installs jaxtyping's import hook (with beartype) on the maths."""
    lt, raw = make_layer(0, 1, 2, 2, 4, 4, 3, 5, False, "plain")
    with pytest.raises(TypeError, match="parameter 'w_o'"):  # head dim 3 vs values' 3 → 2
        LayerTensors(raw["probs"], raw["values"], lt.w_o[..., :2], None, lt.valid)
    with pytest.raises(TypeError, match="token_scores"):
        token_scores(torch.ones(2, 3, 4))  # keys × queries must be square
    with pytest.raises(TypeError, match="entropy"):
        entropy(torch.ones(3, 4))  # needs (..., H, I, T)


def test_no_nan_on_fully_degenerate_layer():
    lt, _ = make_layer(1, 2, 1, 3, 5, 5, 2, 4, False, "zero_w", dtype=torch.float32)
    for name in NAMES:
        out = get_measure(name).compute(lt)
        assert torch.isfinite(out).all(), name
        if name != "attention":
            assert (out == 0).all(), name
    assert lt.degenerate.all()


def test_registry_names_and_errors():
    assert set(NAMES) <= set(measure_names())
    assert "ihc" not in resolve_measures("all")
    assert resolve_measures("contribution, vw,contribution") == ["contribution", "vw"]
    with pytest.raises(ValueError, match=r"valid measures: .*contribution.*vw_on"):
        resolve_measures(["contribution", "nope"])
    with pytest.raises(ValueError, match="valid measures"):
        get_measure("attn")
    with pytest.raises(ValueError, match="no measure named"):
        resolve_measures(" , ")
    assert get_measure("contribution").signed and not get_measure("vw").signed
    assert not get_measure("cosine").is_weight and get_measure("distance").is_weight


def test_distance_blocks_over_queries_heads_and_keys_agree():
    # max_elements small enough to force blocks of one key: the result must not change
    torch.manual_seed(3)
    b, h, g, i, t, dh, d = 2, 4, 2, 5, 7, 3, 6
    probs = torch.rand(b, h, i, t, dtype=torch.float64)
    lt = LayerTensors(
        probs,
        torch.randn(b, g, t, dh, dtype=torch.float64),
        torch.randn(h, d, dh, dtype=torch.float64),
        torch.randn(d, dtype=torch.float64),
        torch.ones(b, i, t, dtype=torch.bool),
    )
    whole = distance(lt, max_elements=1 << 30)
    for budget in (1, b * d, b * d * 3, b * h * d * 2):
        torch.testing.assert_close(distance(lt, max_elements=budget), whole)
