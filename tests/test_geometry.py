"""Geometry and sink analyses against brute-force float64 computations (method §3, §5).

The brute force comes from ``reference.py`` (eager attention + plain hooks, every ṽ
materialised, float64); the package's statistics run streamed, sequence by sequence, in
float32 through the capture observer. Hand-built layers check the known answers.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from reference import (
    allowed,
    eager_run,
    entropy,
    first_token_weight,
    normalise,
    projected_values,
    window,
)
from tiny_models import tiny_model

from contribution_weights.capture import LayerBlock
from contribution_weights.experiments.geometry import (
    GeometryAccumulator,
    GeometryOptions,
    analyse,
    encode_texts,
)
from contribution_weights.experiments.geometry.analyses.norm_fit import NormFit
from contribution_weights.experiments.geometry.analyses.regression import regression_table
from contribution_weights.experiments.geometry.analyses.semantic_cone import (
    SemanticCone,
    cone_geometry,
)
from contribution_weights.experiments.geometry.analyses.sink_alignment import (
    SinkAlignment,
    alignment,
    null_table,
    token_alignment,
)
from contribution_weights.experiments.geometry.analyses.sink_scaling import sink_scaling_nll
from contribution_weights.experiments.stats import (
    BlockView,
    control_token,
    permutation_summary,
    random_tokens,
)
from contribution_weights.measures.layer import LayerTensors

TEXTS = ["The cat sat on the mat.", "A second, longer text for the geometry!", "xyz 123 abc q"]
FAMILIES = ["llama", "gemma3_text"]  # bias + GQA; sliding window + q/k norms
RTOL, ATOL = 2e-4, 2e-5


def brute_layers(lm, texts):
    """Per sequence, per layer: the reference quantities and the projected values."""
    out = []
    for ids in encode_texts(lm, texts, None):
        run = eager_run(lm.model, ids[None])
        t = ids.numel()
        layers = []
        for layer in range(lm.num_layers):
            valid = allowed(t, window(lm.model, layer))
            ref = run.layer(layer, 0, valid)
            ref["vt"] = projected_values(run.values[layer][0], run.weights[layer])
            ref["valid"] = valid
            layers.append(ref)
        out.append(layers)
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request):
    lm = tiny_model(request.param)
    opts = GeometryOptions(max_tokens=None, cap=10**6, gammas=(1.0, 0.5, 0.0), sink_layers=[0, -1])
    result = analyse(lm, TEXTS, None, opts)
    return lm, result, brute_layers(lm, TEXTS), opts


def test_first_token_weight_and_entropy(setup):
    lm, res, brute, _ = setup
    for measure in ("attention", "vw", "contribution"):
        want = [
            np.mean([first_token_weight(normalise(s[l][measure], measure)) for s in brute])
            for l in range(lm.num_layers)
        ]
        np.testing.assert_allclose(
            res.first_token_weight_by_layer[measure], want, rtol=RTOL, atol=ATOL
        )
        assert res.first_token_weight[measure] == pytest.approx(np.mean(want), rel=RTOL, abs=ATOL)
        for excl, row in ((False, "all"), (True, "excluding_first")):
            per_layer = [
                np.mean([float(entropy(s[l][measure], excl).mean()) for s in brute])
                for l in range(lm.num_layers)
            ]
            np.testing.assert_allclose(
                res.entropy_by_layer[f"{measure}:{row}"], per_layer, rtol=RTOL, atol=ATOL
            )
            assert res.entropy.loc[row, measure] == pytest.approx(
                np.mean(per_layer), rel=RTOL, abs=ATOL
            )


def _brute_points(brute):
    rows = []
    for seq in brute:
        for layer, ref in enumerate(seq):
            keep = (
                ref["valid"][None].expand_as(ref["attention"]) & ~ref["degenerate"][None, :, None]
            )
            vnorm = ref["vt"].norm(dim=-1)[:, None, :].expand_as(ref["attention"])
            cols = [
                ref["attention"],
                ref["relative_norm"],
                ref["cosine"],
                ref["contribution"],
                vnorm,
            ]
            first = torch.zeros_like(ref["attention"])
            first[:, :, 0] = 1
            rows.append(
                np.stack(
                    [c[keep].numpy() for c in cols]
                    + [np.full(int(keep.sum()), layer), first[keep].numpy()],
                    1,
                )
            )
    return np.concatenate(rows)


def _sorted(a):
    return a[np.lexsort(a.T[::-1])]


def test_sampled_points_are_all_points_and_r2_matches(setup):
    """With the cap above the number of pairs the reservoir holds every (l, h, i, j) pair."""
    _, res, brute, opts = setup
    want = _brute_points(brute)
    assert res.points["all"] == len(want)
    assert res.points["first"] == int(want[:, 6].sum())
    assert res.points["tail"] == len(want) - int(want[:, 6].sum())
    joint = _sorted(
        res.joint[["alpha", "r", "kappa", "vnorm", "layer", "first"]].to_numpy(np.float64)
    )
    np.testing.assert_allclose(joint, _sorted(want[:, [0, 1, 2, 4, 5, 6]]), rtol=1e-3, atol=1e-5)
    # the regression tables are those of the same points (orders differ, so compare via sorting)
    for log, table in ((False, res.regression_r2), (True, res.log_regression_r2)):
        cols = {"alpha": want[:, 0], "r": want[:, 1], "kappa": want[:, 2], "c": want[:, 3]}
        brute_r2 = regression_table(cols, log=log, folds=opts.folds, seed=opts.seed)
        for name, value in brute_r2.items():
            assert abs(table.loc[name, "all"] - value) < 0.05  # fold assignment differs
        assert table["all"].notna().all()


def test_log_correlations(setup):
    _, res, brute, _ = setup
    pts = _brute_points(brute)
    ok = (pts[:, 0] > 0) & (pts[:, 1] > 0) & (pts[:, 2] != 0)
    logs = np.stack([np.log(pts[ok, 0]), np.log(pts[ok, 1]), np.log(np.abs(pts[ok, 2]))])
    np.testing.assert_allclose(res.correlations.to_numpy(), np.corrcoef(logs), rtol=1e-3, atol=1e-4)


def test_sink_alignment(setup):
    lm, res, brute, _ = setup
    want = np.zeros((lm.num_layers, 2))
    for seq in brute:
        for layer, ref in enumerate(seq):
            vt = ref["vt"]
            heads, t, _ = vt.shape

            def cos(a, b):  # a zero vector counts as cosine 0
                den = float(a.norm() * b.norm())
                return 0.0 if den == 0 else float(a @ b) / den

            st = [np.mean([cos(vt[h, 0], vt[h, j]) for j in range(1, t)]) for h in range(heads)]
            tt = [
                np.mean(
                    [cos(vt[h, i], vt[h, j]) for i in range(1, t) for j in range(1, t) if i != j]
                )
                for h in range(heads)
            ]
            want[layer] += [np.mean(st) / len(brute), np.mean(tt) / len(brute)]
    np.testing.assert_allclose(
        res.sink_alignment[["sink_tail", "tail_tail"]], want, rtol=RTOL, atol=ATOL
    )


def test_norm_fit(setup):
    _, res, brute, _ = setup
    for (layer, head), row in res.norm_fit.set_index(["layer", "head"]).iterrows():
        a = np.concatenate([s[layer]["attention"][head, :, 0].numpy() for s in brute])
        y = np.concatenate([s[layer]["head_outputs"][head].square().sum(-1).numpy() for s in brute])
        v0 = np.concatenate(
            [
                np.full(s[layer]["vt"].shape[1], float(s[layer]["vt"][head, 0].square().sum()))
                for s in brute
            ]
        )
        x = np.stack([2 * a * (1 - a), (1 - a) ** 2], 1)
        coef = np.linalg.lstsq(x, y - a**2 * v0, rcond=None)[0]
        mean_v0 = np.mean([float(s[layer]["vt"][head, 0].square().sum()) for s in brute])
        assert row.gamma_prime == pytest.approx(coef[0], rel=1e-3, abs=1e-6)
        assert row.kappa2 == pytest.approx(coef[1], rel=1e-3, abs=1e-6)
        q = mean_v0 - 2 * coef[0] + coef[1]
        assert row.alpha_min == pytest.approx((coef[1] - coef[0]) / q, rel=1e-3, abs=1e-5)
        assert row.convex == (q > 0)


def test_semantic_cone(setup):
    _, res, brute, opts = setup
    counts = np.zeros(6)
    for seq in brute:
        for ref in seq:
            vt, out, a = ref["vt"], ref["head_outputs"], ref["attention"]
            for h in range(vt.shape[0]):
                mu = vt[h, 1:].mean(0)
                mu = mu / mu.norm()
                nonzero = vt[h, 1:].norm(dim=-1) > 0  # zero values have no direction
                cos_tail = (vt[h, 1:][nonzero] @ mu) / vt[h, 1:][nonzero].norm(dim=-1)
                cone = np.quantile(cos_tail.numpy(), 1 - opts.cone_coverage)
                o = out[h, 1:]
                o_ns = o - a[h, 1:, 0, None] * vt[h, 0]

                def inside(v, mu=mu, cone=cone):
                    return ((v @ mu) / v.norm(dim=-1) >= cone).numpy()

                norm = o.norm(dim=-1).numpy()
                low = norm <= np.quantile(norm, opts.low_quantile)
                counts += [
                    low.sum(),
                    (low & inside(o)).sum(),
                    (low & inside(o_ns)).sum(),
                    len(norm),
                    inside(o).sum(),
                    inside(o_ns).sum(),
                ]
    got = res.semantic_cone.loc["all"]
    assert got["low_norm_outputs"] == counts[0]
    assert got["low_inside_with_sink"] == pytest.approx(counts[1] / counts[0], abs=0.02)
    assert got["low_inside_without_sink"] == pytest.approx(counts[2] / counts[0], abs=0.02)
    assert got["all_inside_with_sink"] == pytest.approx(counts[4] / counts[3], abs=0.02)
    assert got["all_inside_without_sink"] == pytest.approx(counts[5] / counts[3], abs=0.02)


def _hooked_nll(lm, ids, layers, gamma, position=0):
    """Mean NLL with v_position × γ by a plain forward hook on v_proj (eager attention)."""
    attn = [m for n, m in lm.model.named_modules() if n.endswith("self_attn")]

    def scale(_m, _i, out, p=position, g=gamma):
        return torch.cat([out[:, :p], out[:, p : p + 1] * g, out[:, p + 1 :]], 1)

    handles = [attn[i].v_proj.register_forward_hook(scale) for i in layers]
    try:
        previous = lm.model.config._attn_implementation
        lm.model.set_attn_implementation("eager")
        with torch.no_grad():
            logits = lm.model(input_ids=ids[None], use_cache=False).logits[0].double()
    finally:
        for handle in handles:
            handle.remove()
        lm.model.set_attn_implementation(previous)
    logp = torch.log_softmax(logits[:-1], -1)
    return float(-logp[torch.arange(ids.numel() - 1), ids[1:]].mean())


def test_sink_scaling_matches_value_hook(setup):
    """γ v_0 via a plain forward hook on v_proj (eager attention) gives the same NLL; so
    does the control: γ v_c at each text's control token c in the same layers."""
    lm, res, _, opts = setup
    layers = [0, lm.num_layers - 1]
    assert res.sink_scaling.layers == layers
    texts = encode_texts(lm, TEXTS, None)
    controls = [control_token(ids.numel(), opts.seed, i) for i, ids in enumerate(texts)]
    assert all(
        c is not None and 1 <= c <= ids.numel() - 2 for c, ids in zip(controls, texts, strict=True)
    )
    runs = ((res.sink_scaling.table, [0] * len(texts)), (res.sink_scaling.control, controls))
    for k, gamma in enumerate(opts.gammas):
        for table, positions in runs:
            nll = [
                _hooked_nll(lm, x, layers, gamma, p) for x, p in zip(texts, positions, strict=True)
            ]
            assert table["nll_mean"][k] == pytest.approx(np.mean(nll), rel=1e-4)
            assert table["ppl_mean"][k] == pytest.approx(np.mean(np.exp(nll)), rel=1e-4)
    # γ = 1: the control's row is the clean pass, as the sink's
    clean = res.sink_scaling.table.set_index("gamma").loc[1.0]
    pd_control = res.sink_scaling.control.set_index("gamma").loc[1.0]
    assert pd_control["ppl_mean"] == clean["ppl_mean"] and pd_control["n"] == clean["n"]


def test_control_scaling_at_gamma_one_is_the_clean_perplexity():
    """sink_scaling_nll with a control token: at γ = 1 both the sink's and the control's
    NLL are a plain forward pass's; at γ = 0 the control's is the hooked one's at c."""
    lm = tiny_model("llama")
    ids = encode_texts(lm, TEXTS[1:2], None)[0]
    layers = list(range(lm.num_layers))
    clean = _hooked_nll(lm, ids, [], 1.0)
    got = sink_scaling_nll(lm, ids, [1.0, 0.0], layers, control=3)
    assert got[0] == pytest.approx(clean, rel=1e-5) and got[2] == pytest.approx(clean, rel=1e-5)
    assert got[1] == pytest.approx(_hooked_nll(lm, ids, layers, 0.0, 0), rel=1e-4)
    assert got[3] == pytest.approx(_hooked_nll(lm, ids, layers, 0.0, 3), rel=1e-4)
    assert got[3] != got[1]  # another token: another curve
    with pytest.raises(ValueError, match="outside the sequence"):
        sink_scaling_nll(lm, ids, [1.0], layers, control=ids.numel())


def test_streaming_state_round_trip_equals_one_pass():
    """Two sequences, state saved and loaded into a fresh accumulator, then a third == all three."""
    lm = tiny_model("llama")
    opts = GeometryOptions(max_tokens=None, cap=300)  # cap below the number of pairs
    ids = encode_texts(lm, TEXTS, None)
    names = [
        "regression",
        "correlations",
        "first_token_weight",
        "entropy",
        "sink_alignment",
        "norm_fit",
        "semantic_cone",
    ]
    one = GeometryAccumulator(lm.num_layers, lm.num_heads, names, opts)
    for x in ids:
        one.add_sequence(lm, x)
    first = GeometryAccumulator(lm.num_layers, lm.num_heads, names, opts)
    for x in ids[:2]:
        first.add_sequence(lm, x)
    state = first.state_dict()
    second = GeometryAccumulator(lm.num_layers, lm.num_heads, names, opts)
    second.load_state_dict(state)
    second.add_sequence(lm, ids[2])
    a, b = one.result(), second.result()
    assert a.points["all"] == 300 and len(one.stats["points"].all.keys) == 300
    np.testing.assert_array_equal(
        _sorted(one.stats["points"].all.rows.numpy()),
        _sorted(second.stats["points"].all.rows.numpy()),
    )
    assert a.to_json() == b.to_json()


def test_reservoir_and_moments_equal_in_memory():
    from contribution_weights.experiments.sampling import Moments, Reservoir

    rng = np.random.default_rng(0)
    data = rng.normal(size=(5000, 3)) @ np.array([[1, 0.5, 0], [0, 1, 0.2], [0, 0, 1]]) + 3
    mom, res = Moments(["a", "b", "c"]), Reservoir(["a", "b", "c"], cap=10**6)
    small = Reservoir(["a", "b", "c"], cap=100)
    for chunk in np.array_split(data, 17):
        mom.add(chunk)
        res.add(torch.tensor(chunk, dtype=torch.float32))
        small.add(torch.tensor(chunk, dtype=torch.float32))
    np.testing.assert_allclose(mom.correlation(), np.corrcoef(data.T), rtol=1e-10)
    np.testing.assert_allclose(mom.mean, data.mean(0), rtol=1e-12)
    assert res.seen == 5000 and len(res) == 5000
    np.testing.assert_allclose(_sorted(res.rows.numpy()), _sorted(data.astype(np.float32)))
    assert len(small) == 100 and small.seen == 5000
    rows = {tuple(r) for r in data.astype(np.float32).tolist()}
    assert all(tuple(r) in rows for r in small.rows.tolist())


# ---- hand-built layers with known answers ------------------------------------------------------
class _HandBuiltCall:
    """Stands in for a capture's LayerCall of layer 0 whose block tensors are given."""

    layer_idx = 0

    def __init__(self, lt: LayerTensors) -> None:
        self.lt = lt

    def layer_tensors(self, rows, probs, dtype, **_):
        return self.lt


def _layer(values: torch.Tensor, probs: torch.Tensor) -> BlockView:
    """One head, W_O = identity: ṽ_j = v_j."""
    t, d = values.shape
    lt = LayerTensors(
        probs[None, None].double(),
        values[None, None].double(),
        torch.eye(d, dtype=torch.float64)[None],
        None,
        torch.ones(t, t, dtype=torch.bool).tril()[None],
    )
    block = LayerBlock(_HandBuiltCall(lt), slice(0, t), lt.probs)
    return BlockView(block, t, torch.float64)


def _probs(first: torch.Tensor, t: int) -> torch.Tensor:
    """Causal rows with α_i0 = first[i] and the rest spread evenly over keys 1..i."""
    p = torch.zeros(t, t, dtype=torch.float64)
    p[0, 0] = 1
    for i in range(1, t):
        p[i, 0] = first[i]
        p[i, 1 : i + 1] = (1 - first[i]) / i
    return p


def test_sink_opposite_the_mean_value():
    """s = −m: alignment −1 / +1, γ' = ⟨s, m⟩ < 0 exactly, convex with α_min < 1."""
    t = 12
    m, s = torch.tensor([1.0, 0.0]), torch.tensor([-0.5, 0.0])
    values = torch.cat([s[None], m.expand(t - 1, 2)])
    sink_tail, tail_tail = alignment(values[None].double())
    assert float(sink_tail[0]) == pytest.approx(-1) and float(tail_tail[0]) == pytest.approx(1)
    fit = NormFit(1, 1)
    fit.observe(_layer(values, _probs(torch.linspace(0, 1, t), t)))
    row = fit.fit()[0]
    assert row["gamma_prime"] == pytest.approx(-0.5) and row["kappa2"] == pytest.approx(1.0)
    assert row["v0_norm2"] == pytest.approx(0.25) and row["r2"] == pytest.approx(1.0)
    assert row["alpha_min"] == pytest.approx(1.5 / 2.25) and row["convex_min_below_1"]


def test_sink_aligned_with_the_mean_has_no_interior_minimum():
    t = 12
    m, s = torch.tensor([1.0, 0.0]), torch.tensor([0.9, 0.0])  # γ' = 0.9 > ‖s‖² = 0.81
    values = torch.cat([s[None], m.expand(t - 1, 2)])
    fit = NormFit(1, 1)
    fit.observe(_layer(values, _probs(torch.linspace(0, 1, t), t)))
    row = fit.fit()[0]
    assert row["gamma_prime"] == pytest.approx(0.9) and row["alpha_min"] >= 1
    assert not row["convex_min_below_1"]


def test_cone_low_norm_outputs_collapse_without_the_sink():
    """Tail values in a narrow cone round e1, sink (−1, 0.5): the cancelling outputs leave the
    cone with the sink and fall back inside it without (positive combinations stay inside)."""
    t = 20
    gen = torch.Generator().manual_seed(0)
    tail = torch.stack([torch.ones(t - 1), 0.1 * torch.randn(t - 1, generator=gen)], 1)
    values = torch.cat([torch.tensor([[-1.0, 0.5]]), tail])
    geo = cone_geometry(values[None].double(), coverage=1.0)
    assert float(geo.sink[0, 0]) < 0 and float(geo.sink[0, 1]) > 0
    first = torch.linspace(0.05, 0.6, t)  # α_i0 ≈ 0.5 cancels the e1 component
    cone = SemanticCone(1, 1, low_quantile=0.25, coverage=1.0)
    cone.begin(t)
    cone.observe(_layer(values, _probs(first, t)))
    cone.end()
    low_with, low_without, _, all_without = cone.fractions()[0]
    assert low_without == 1.0 and all_without == 1.0
    assert low_with == 0.0


def test_resolve_analyses_errors():
    from contribution_weights.experiments.geometry import resolve_analyses

    assert resolve_analyses("regression_r2,entropy") == ["regression", "entropy"]
    with pytest.raises(ValueError, match=r"unknown analysis .bogus.; valid analyses:"):
        resolve_analyses("bogus")


def test_math_is_finite_on_one_token():
    lm = tiny_model("llama")
    res = analyse(
        lm,
        ["a"],
        None,
        GeometryOptions(max_tokens=None, cap=100, gammas=(1.0, 0.0), sink_layers=[0]),
    )
    js = res.to_json()
    assert js["first_token_weight"]["attention"] == pytest.approx(
        1 / 1
    )  # one token: all on token 0
    assert all(
        not (isinstance(v, float) and math.isnan(v)) for v in js["first_token_weight"].values()
    )


def test_sink_layers_are_resolved_like_trace_layers():
    def resolved(layers: list[int]) -> list[int]:
        acc = GeometryAccumulator(4, 2, ["sink_scaling"], GeometryOptions(sink_layers=layers))
        return acc.resolve_sink_layers()

    assert resolved([-1, 0, 3]) == [0, 3]
    with pytest.raises(ValueError, match="out of range"):
        resolved([4])
    with pytest.raises(ValueError, match="out of range"):
        resolved([-5])


def test_statistics_do_not_depend_on_query_blocks(monkeypatch):
    import functools

    from contribution_weights.experiments.geometry import run as geometry_module

    lm = tiny_model("llama")
    names = ["first_token_weight", "entropy", "sink_alignment", "correlations"]
    opts = GeometryOptions(max_tokens=None, cap=10**6)
    whole = analyse(lm, TEXTS, names, opts)
    small = functools.partial(geometry_module.capturing, block_bytes=1)  # one query per block
    monkeypatch.setattr(geometry_module, "capturing", small)
    blocks = analyse(lm, TEXTS, names, opts)
    for table in ("first_token_weight_by_layer", "entropy_by_layer", "sink_alignment"):
        np.testing.assert_allclose(
            getattr(blocks, table), getattr(whole, table), rtol=RTOL, atol=ATOL
        )
    # float32 scores differ in the last bit between block shapes (GEMM tiling)
    np.testing.assert_allclose(blocks.correlations, whole.correlations, rtol=1e-5)


# ---- null controls ----------------------------------------------------------------------------
def test_control_and_random_tokens_are_seeded_non_sink_positions():
    draws = random_tokens(10, 500, seed=3, unit=7, stream=1)
    assert draws.min() == 1 and draws.max() == 9  # never the sink, every other token
    np.testing.assert_array_equal(draws, random_tokens(10, 500, seed=3, unit=7, stream=1))
    assert not np.array_equal(draws, random_tokens(10, 500, seed=3, unit=8, stream=1))
    assert not np.array_equal(draws, random_tokens(10, 500, seed=4, unit=7, stream=1))
    assert len(random_tokens(1, 5, 0, 0, 1)) == 0
    controls = {control_token(10, seed, unit) for seed in range(5) for unit in range(40)}
    assert controls == set(range(1, 9))  # never the sink nor the last token
    assert control_token(2, 0, 0) == 1 and control_token(1, 0, 0) is None


def test_permutation_summary_known_answers():
    draws = np.array([1.0, 2.0, 3.0, 4.0, np.nan])  # NaN draws are left out
    got = permutation_summary(2.5, draws, "less")
    assert got["null_mean"] == 2.5 and got["null_sd"] == pytest.approx(np.std([1, 2, 3, 4], ddof=1))
    assert got["p_value"] == pytest.approx(3 / 5)  # (1 + #{1, 2}) / (1 + 4)
    assert permutation_summary(0.0, draws, "less")["p_value"] == pytest.approx(1 / 5)
    assert permutation_summary(0.0, draws, "greater")["p_value"] == 1.0
    assert math.isnan(permutation_summary(float("nan"), draws)["p_value"])
    assert math.isnan(permutation_summary(1.0, np.array([]))["null_mean"])
    with pytest.raises(ValueError, match="alternative"):
        permutation_summary(1.0, draws, "two-sided")


def test_alignment_null_of_token_zero_is_the_statistic():
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(3, 9, 4, generator=gen, dtype=torch.float64)
    values[1, 4] = 0  # a zero vector counts as cosine 0
    sink_tail, _ = alignment(values)
    got = token_alignment(values, torch.tensor([0, 4, 7]))
    torch.testing.assert_close(got[:, 0], sink_tail)
    unit = values / values.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    for k, c in enumerate((4, 7)):  # mean over j ≠ c of cos(ṽ_c, ṽ_j), j = 0 included
        others = [j for j in range(9) if j != c]
        want = (unit[:, others] @ unit[:, c, :, None]).squeeze(-1).mean(-1)
        torch.testing.assert_close(got[:, k + 1], want)


def test_alignment_null_p_value_is_uniform_on_noise():
    """Values that are pure noise make token 0 exchangeable with the others: over many
    replicates the p-value of the sink/tail cosine is uniform (Kolmogorov–Smirnov)."""
    gen = torch.Generator().manual_seed(0)
    t = 8
    probs = _probs(torch.full((t,), 0.3), t)
    p_values = []
    for replicate in range(200):
        stat = SinkAlignment(1, seed=replicate, draws=99)
        for unit in range(3):
            stat.begin(t, unit)
            stat.observe(_layer(torch.randn(t, 3, generator=gen), probs))
            stat.end()
        draws = stat.null_draws()
        assert draws is not None
        by_layer = pd.DataFrame(stat.by_layer(), columns=["sink_tail", "tail_tail"])
        p_values.append(null_table(by_layer, draws).loc["mean", "p_value"])
    p = np.sort(p_values)
    ks = np.max(np.abs(p - np.arange(1, len(p) + 1) / len(p)))
    assert ks < 0.12, ks  # the 1% critical value for 200 draws is 0.115
    assert 0.02 <= np.mean(p <= 0.1) <= 0.2


def test_alignment_null_finds_a_sink_opposite_the_tail():
    """The hand-built sink opposite the tail: every random token is aligned with the tail,
    so the sink's cosine is below every draw and p = 1/(draws + 1)."""
    t = 12
    gen = torch.Generator().manual_seed(2)
    tail = torch.tensor([1.0, 0.0]) + 0.05 * torch.randn(t - 1, 2, generator=gen)
    values = torch.cat([torch.tensor([[-0.5, 0.0]]), tail])
    stat = SinkAlignment(1, seed=0, draws=49)
    stat.begin(t, 0)
    stat.observe(_layer(values, _probs(torch.linspace(0, 1, t), t)))
    stat.end()
    table = null_table(pd.DataFrame(stat.by_layer(), columns=["sink_tail", "tail_tail"]),
                       stat.null_draws())  # fmt: skip
    assert table.loc["mean", "p_value"] == pytest.approx(1 / 50)
    assert table.loc["mean", "null_mean"] > 0.5 > table.loc["mean", "sink_tail"]


def test_norm_fit_null_of_token_zero_is_the_fit():
    """The null with its control token set to 0 is the sink's fit, on a real model."""

    class AtTheSink(NormFit):
        def token_for(self, num_tokens, unit):
            return 0

    lm = tiny_model("llama")
    real, null = NormFit(lm.num_layers, lm.num_heads), AtTheSink(lm.num_layers, lm.num_heads,
                                                                control_seed=0)  # fmt: skip
    acc = GeometryAccumulator(lm.num_layers, lm.num_heads, [], GeometryOptions(max_tokens=None))
    acc.stats = {"real": real, "null": null}
    for unit, ids in enumerate(encode_texts(lm, TEXTS, None)):
        acc.add_sequence(lm, ids, unit)
    assert null.points == [] and real.fit() == null.fit()


def test_norm_fit_null_known_answer_at_the_control_token():
    """Every value m but the control token's s: ‖o‖² = α²‖s‖² + 2α(1−α)⟨s, m⟩ + (1−α)²‖m‖²
    exactly in α = α_ic, so the null fits γ' = ⟨s, m⟩ and κ'² = ‖m‖² with R² = 1."""
    t, seed = 12, 5
    c = control_token(t, seed, 0)
    m, s = torch.tensor([1.0, 0.5]), torch.tensor([-0.5, 0.25])
    values = m.expand(t, 2).clone()
    values[c] = s
    probs = torch.zeros(t, t, dtype=torch.float64)  # α_ic varies over the queries i ≥ c
    for i in range(t):
        probs[i, : i + 1] = 1.0 / (i + 1)
        if i >= c:
            probs[i, c] = (i - c + 1) / t
            probs[i, [j for j in range(i + 1) if j != c]] = (1 - probs[i, c]) / i
    fit = NormFit(1, 1, control_seed=seed)
    fit.begin(t, 0)
    fit.observe(_layer(values, probs))
    fit.end()
    row = fit.fit()[0]
    assert row["n"] == t - c  # the queries that can see c
    assert row["gamma_prime"] == pytest.approx(float(s @ m))
    assert row["kappa2"] == pytest.approx(float(m @ m)) and row["r2"] == pytest.approx(1.0)
    assert row["v0_norm2"] == pytest.approx(float(s @ s))


def test_cone_null_of_token_zero_is_the_statistic(monkeypatch):
    """With every draw at token 0 the null removes the sink's value: each draw is the
    fraction inside without the sink. With random tokens the hand-built sink (which
    cancels the tail's direction) is the only token whose removal brings the low-norm
    outputs in: every draw is 0 and p = 1/(draws + 1)."""
    from contribution_weights.experiments.geometry.analyses import semantic_cone

    t = 20
    gen = torch.Generator().manual_seed(0)
    tail = torch.stack([torch.ones(t - 1), 0.1 * torch.randn(t - 1, generator=gen)], 1)
    values = torch.cat([torch.tensor([[-1.0, 0.5]]), tail])
    probs = _probs(torch.linspace(0.05, 0.6, t), t)

    def run():
        cone = SemanticCone(1, 1, low_quantile=0.25, coverage=1.0, seed=0, draws=24)
        cone.begin(t)
        cone.observe(_layer(values, probs))
        cone.end()
        return cone

    cone = run()
    null = cone.null_fractions()
    assert null is not None and (null[:, 0] == 0).all()
    table = pd.DataFrame([cone.fractions()[0]], columns=list(semantic_cone.FRACTIONS))
    got = semantic_cone.null_table(table, null[:1])
    assert got.loc[0, "low_p_value"] == pytest.approx(1 / 25)
    assert got.loc[0, "low_inside_without_sink"] == 1.0

    monkeypatch.setattr(semantic_cone, "random_tokens", lambda t, k, *a: np.zeros(k, np.int64))
    cone = run()
    _, low_without, _, all_without = cone.fractions()[0]
    np.testing.assert_allclose(cone.null_fractions()[0], [[low_without] * 24, [all_without] * 24])
