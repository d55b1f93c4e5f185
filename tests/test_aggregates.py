"""Aggregates of method §3 (token scores, normalised weights, first-token weight, entropy)
against loops in :mod:`reference`, on random weights and on a traced tiny model."""

from __future__ import annotations

import pytest
import reference as ref
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import tiny_model

import contribution_weights as cw
from contribution_weights.measures import aggregates

F64 = torch.float64
WEIGHTS = ["attention", "contribution", "intra", "vw", "vw_on", "distance", "ihc"]


def random_weights(seed: int, layers: int, heads: int, t: int, signed: bool, zero_rows: bool):
    """``(L, H, T, T)`` lower-triangular weights, optionally signed and with zero rows."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.rand(layers, heads, t, t, generator=gen, dtype=F64)
    if signed:
        w = w * 2 - 0.7
    w = w * torch.ones(t, t, dtype=F64).tril()
    if zero_rows:
        w[:, :, torch.rand(t, generator=gen) < 0.3] = 0
    return w


weights = st.builds(
    random_weights,
    seed=st.integers(0, 2**31 - 1),
    layers=st.integers(1, 3),
    heads=st.integers(1, 4),
    t=st.integers(2, 8),
    signed=st.booleans(),
    zero_rows=st.booleans(),
)


@settings(max_examples=40, deadline=None)
@given(w=weights)
def test_token_scores(w):
    got = aggregates.token_scores(w)
    assert got.shape == w.shape[:-1]
    for layer in range(w.shape[0]):
        torch.testing.assert_close(got[layer], ref.token_scores(w[layer]))


@settings(max_examples=40, deadline=None)
@given(w=weights, measure=st.sampled_from(WEIGHTS))
def test_normalised_and_first_token_weight(w, measure):
    if measure in ("vw", "vw_on", "ihc"):
        w = w.abs()  # non-negative by definition; their normalisation divides by the row sum
    got = aggregates.normalised(w, measure)
    first = aggregates.first_token_weight(got)
    assert first.shape == (w.shape[0],)
    for layer in range(w.shape[0]):
        want = ref.normalise(w[layer], measure)
        torch.testing.assert_close(got[layer], want)
        assert first[layer].item() == pytest.approx(ref.first_token_weight(want), abs=1e-12)


def test_normalised_weights_sum_to_one_per_query():
    w = random_weights(0, 2, 3, 6, signed=False, zero_rows=False)
    for measure in ("vw", "vw_on", "ihc"):
        sums = aggregates.normalised(w, measure).sum(dim=(1, 3))
        torch.testing.assert_close(sums, torch.ones_like(sums))
    probs = torch.softmax(torch.randn(2, 3, 6, 6, dtype=F64).masked_fill(w == 0, -torch.inf), -1)
    sums = aggregates.normalised(probs, "attention").sum(dim=(1, 3))
    torch.testing.assert_close(sums, torch.ones_like(sums))


@pytest.mark.parametrize("measure", ["relative_norm", "cosine"])
def test_non_weights_have_no_normalisation(measure):
    with pytest.raises(ValueError, match="not a weight"):
        aggregates.normalised(torch.ones(1, 1, 2, 2), measure)


@settings(max_examples=40, deadline=None)
@given(w=weights, exclude_first=st.booleans())
def test_entropy(w, exclude_first):
    got = aggregates.entropy(w, exclude_first=exclude_first)
    assert got.shape == w.shape[:2]
    assert torch.isfinite(got).all()
    for layer in range(w.shape[0]):
        torch.testing.assert_close(got[layer], ref.entropy(w[layer], exclude_first))


def test_entropy_known_values():
    t = 4
    uniform = torch.ones(1, t, t, dtype=F64).tril()  # query i spreads over i + 1 keys
    want = sum(torch.log(torch.tensor(i + 1.0)).item() for i in range(t)) / t
    assert aggregates.entropy(uniform).item() == pytest.approx(want)
    sink = torch.zeros(1, t, t, dtype=F64)
    sink[..., 0] = 1.0  # everything on token 0: entropy 0, and 0 without token 0 (no weight)
    assert aggregates.entropy(sink).item() == 0
    assert aggregates.entropy(sink, exclude_first=True).item() == 0


def test_trace_summary_matches_brute_force():
    loaded = tiny_model("llama")
    names = ["attention", "contribution", "intra", "vw", "vw_on", "distance"]
    tr = cw.trace(loaded, "summary check!", measures=names, compute_dtype="float64")
    summary = tr.summary()
    assert set(summary.index) == {"attention", "contribution", "intra", "vw", "vw_on", "distance"}
    for name in summary.index:
        w = tr[name]
        per_layer = [ref.first_token_weight(ref.normalise(w[i], name)) for i in range(w.shape[0])]
        ent = torch.stack([ref.entropy(w[i]) for i in range(w.shape[0])]).mean().item()
        ent1 = torch.stack([ref.entropy(w[i], True) for i in range(w.shape[0])]).mean().item()
        row = summary.loc[name]
        assert row["first_token_weight"] == pytest.approx(sum(per_layer) / len(per_layer))
        assert row["entropy"] == pytest.approx(ent)
        assert row["entropy_excl_first"] == pytest.approx(ent1)
    by_layer = tr.first_token_weight_by_layer()
    assert list(by_layer.index) == tr.layers
    assert by_layer["attention"].mean() == pytest.approx(
        summary.loc["attention", "first_token_weight"]
    )


@pytest.mark.parametrize("measure", ["attention", "contribution", "intra", "vw", "vw_on", "ihc"])
def test_first_token_weight_of_a_measure_equals_normalising_every_key(measure):

    torch.manual_seed(0)
    w = torch.randn(3, 4, 6, 6, dtype=torch.float64).tril()
    if measure != "contribution" and measure != "intra":
        w = w.abs()
    expected = aggregates.first_token_weight(aggregates.normalised(w, measure))
    torch.testing.assert_close(aggregates.first_token_weight(w, measure), expected)
