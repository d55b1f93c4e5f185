"""Capture and trace on tiny random models of every family, against the eager model.

The reference side (:mod:`reference`) reads α from the model's own eager attention, the
values and the output projection's output from plain forward hooks, and computes every
measure the naive way in float64.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
from reference import allowed, eager_logits, eager_run, output_projection, window
from tiny_models import tiny_model

import contribution_weights as cw
from contribution_weights.capture import (
    ATTN_IMPLEMENTATION,
    BlockClosedError,
    LayerBlock,
    LayerCall,
    capturing,
)
from contribution_weights.measures.registry import get_measure

MEASURES = ["attention", "contribution", "intra", "relative_norm", "cosine", "vw", "vw_on"]
ALL = [*MEASURES, "distance", "ihc"]
IDS = torch.tensor([5, 17, 3, 88, 42, 9, 61, 23, 7, 70, 11])


def _ids(seed: int = 1, length: int = 11) -> torch.Tensor:
    return torch.randint(0, 99, (length,), generator=torch.Generator().manual_seed(seed))


def assert_close_rel(
    actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str, floor: float = 1e-3
) -> None:
    """Elementwise |a − e| ≤ rtol·|e| + floor·rtol·max|e|: relative, with a floor for near-zeros
    (entries that cancel to ~0, where only an error relative to the row's scale makes sense)."""
    expected = expected.to(torch.float64)
    actual = actual.to(torch.float64)
    scale = expected.abs().max().item()
    tol = rtol * (expected.abs() + floor * scale) + 1e-300
    err = (actual - expected).abs()
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    assert (err <= tol).all(), f"{what}: max error {err.max().item():.3g} (scale {scale:.3g})"


class Recorder:
    """A test observer: keeps the probs, and LayerTensors in float64, per layer."""

    def __init__(self) -> None:
        self.probs: dict[int, list[torch.Tensor]] = {}
        self.outputs: dict[int, list[torch.Tensor]] = {}
        self.measures: dict[int, list[dict[str, torch.Tensor]]] = {}

    def observe(self, view: LayerBlock) -> None:
        lt = view.tensors(torch.float64)
        self.probs.setdefault(view.layer_idx, []).append(view.probs.detach().clone())
        self.outputs.setdefault(view.layer_idx, []).append(lt.output)
        names = [*MEASURES, "distance"]
        computed = {name: get_measure(name).compute(lt) for name in names}
        computed["bias_share"] = lt.bias_share
        self.measures.setdefault(view.layer_idx, []).append(computed)

    def joined(self, layer: int, name: str) -> torch.Tensor:
        parts = [m[name] for m in self.measures[layer]]
        return torch.cat(parts, dim=2 if parts[0].dim() == 4 else 1)


# ---- exactness of the forward pass and restoration of the model --------------------------------
def test_logits_identical_to_eager(family_model):
    model = family_model.model
    ids = IDS[None]
    expected = eager_logits(model, ids)
    with torch.no_grad(), capturing(model, [Recorder()]):
        got = model(input_ids=ids, use_cache=False).logits
    assert torch.equal(got, expected)


def test_capture_with_nothing_to_observe_is_the_plain_forward(family_model):
    """No observer, no intervention: every layer runs the model's own kernel, so the logits
    are the plain forward's to the bit; kernel="eager" makes them eager's to the bit."""
    model = family_model.model
    ids = IDS[None]
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
    with torch.no_grad(), capturing(model) as session:
        got = model(input_ids=ids, use_cache=False).logits
    assert session.layers_seen == list(range(family_model.num_layers))
    softcapped = getattr(model.config, "attn_logit_softcapping", None) is not None
    if softcapped:  # sdpa has no soft-cap: those layers stay eager, as traced ones do
        torch.testing.assert_close(got, plain, rtol=1e-4, atol=1e-5)
    else:
        assert torch.equal(got, plain)
    with torch.no_grad(), capturing(model, kernel="eager"):
        eager = model(input_ids=ids, use_cache=False).logits
    assert torch.equal(eager, eager_logits(model, ids))
    with pytest.raises(ValueError, match="kernel='flash'"), capturing(model, kernel="flash"):
        pass


def test_model_restored_even_after_an_exception(family_model):
    model = family_model.model
    before = model.config._attn_implementation
    assert before != ATTN_IMPLEMENTATION
    model.train()
    with capturing(model):
        assert model.config._attn_implementation == ATTN_IMPLEMENTATION
        assert not model.training
    assert model.config._attn_implementation == before and model.training

    model.eval()
    with pytest.raises(RuntimeError, match="boom"), capturing(model):
        assert model.config._attn_implementation == ATTN_IMPLEMENTATION
        raise RuntimeError("boom")
    assert model.config._attn_implementation == before and not model.training


def test_attention_rows_are_causal_and_sum_to_one(family_model):
    tr = cw.trace(family_model, IDS, measures="attention", compute_dtype="float64")
    t = len(IDS)
    for pos, layer in enumerate(tr.layers):
        a = tr["attention"][pos]
        ok = allowed(t, window(family_model.model, layer))
        torch.testing.assert_close(a.sum(-1), torch.ones_like(a.sum(-1)), rtol=0, atol=1e-6)
        assert (a[:, ~ok] == 0).all(), f"layer {layer}: attention outside the causal/window mask"
        assert (a[:, ok] > 0).all()
    if window(family_model.model, 0) is not None:
        assert (~allowed(t, window(family_model.model, 0)) & allowed(t, None)).any()


def test_head_outputs_sum_to_the_output_projection(family_model):
    model = family_model.model
    rec = Recorder()
    hooked: dict[int, torch.Tensor] = {}
    handles = [
        output_projection(model, layer).register_forward_hook(
            lambda _m, _i, out, layer=layer: hooked.__setitem__(layer, out.detach())
        )
        for layer in range(family_model.num_layers)
    ]
    try:
        with torch.no_grad(), capturing(model, [rec]):
            model(input_ids=IDS[None], use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    for layer in range(family_model.num_layers):
        ours = torch.cat(rec.outputs[layer], dim=1)
        torch.testing.assert_close(ours, hooked[layer].double(), rtol=1e-5, atol=1e-6)


# ---- every measure against the brute-force float64 reference -----------------------------------
@pytest.mark.parametrize("dtype, rtol, floor", [("float64", 1e-5, 1e-3), ("float32", 2e-3, 0.05)])
def test_measures_match_reference(family_model, dtype, rtol, floor):
    run = eager_run(family_model.model, IDS[None])
    tr = cw.trace(family_model, IDS, measures=[*ALL], compute_dtype=dtype)
    assert set(tr.measures) == set(ALL)
    for pos, layer in enumerate(tr.layers):
        ref = run.layer(layer, 0, allowed(len(IDS), window(family_model.model, layer)))
        for name in tr.measures:
            assert tr[name].dtype == getattr(torch, dtype)
            what = f"{name} layer {layer} ({dtype})"
            assert_close_rel(tr[name][pos], ref[name], rtol, what, floor)
        torch.testing.assert_close(
            tr.bias_share[pos].double(), ref["bias_share"], atol=rtol, rtol=0
        )
        assert not tr.degenerate[pos].any()
    if dtype == "float64":
        check_identities_and_sums(tr, family_model)


def check_identities_and_sums(tr: cw.Trace, loaded: cw.LoadedModel) -> None:
    a, c, r, k = (tr[m].tensor() for m in ("attention", "contribution", "relative_norm", "cosine"))
    torch.testing.assert_close(c, a * r * k, rtol=1e-10, atol=1e-12)  # ĉ = α r κ
    torch.testing.assert_close(
        tr["vw_on"].tensor(), a * r, rtol=1e-10, atol=1e-12
    )  # α‖ṽ‖/‖o‖ = α r
    torch.testing.assert_close(tr["ihc"].tensor(), c.abs(), rtol=0, atol=0)
    torch.testing.assert_close(c.sum(dim=(1, 3)), 1 - tr.bias_share, rtol=0, atol=1e-10)
    intra_sum = tr["intra"].sum(-1)
    torch.testing.assert_close(intra_sum, torch.ones_like(intra_sum), rtol=0, atol=1e-10)
    # D sums to 1 per query, or to 0 where every term is clamped (a query with a large bias
    # share can have ‖o_i − α_ij ṽ_j‖₁ ≥ ‖o_i‖₁ for all (h, j)).
    d_sum = tr["distance"].sum(dim=(1, 3))
    assert ((d_sum - 1).abs() < 1e-10).logical_or(d_sum == 0).all()
    assert ((d_sum - 1).abs() < 1e-10).float().mean() > 0.5
    assert (tr["distance"] >= 0).all() and (tr["vw"] >= 0).all()
    has_bias = output_projection(loaded.model, 0).bias is not None
    assert (tr.bias_share.abs() > 0).any() == has_bias


def test_layer_subset_matches_reference():
    loaded = tiny_model("gemma2")
    run = eager_run(loaded.model, IDS[None])
    tr = cw.trace(loaded, IDS, measures=["ihc"], layers=[-1, 0], compute_dtype="float64")
    assert tr.layers == [0, 2] and tr["ihc"].shape == (2, 4, len(IDS), len(IDS))
    for pos, layer in enumerate(tr.layers):
        ref = run.layer(layer, 0, allowed(len(IDS), window(loaded.model, layer)))
        assert_close_rel(tr["ihc"][pos], ref["ihc"], 1e-5, f"ihc layer {layer}")


# ---- degenerate rows ----------------------------------------------------------------------------
def _assert_finite(tr: cw.Trace) -> None:
    for name, t in ((n, tr[n].tensor()) for n in tr.measures):
        assert torch.isfinite(t).all(), name
    assert torch.isfinite(tr.bias_share).all()


def test_zero_output_projection_gives_zeros_and_flags(family_model):
    model = family_model.model
    with torch.no_grad():
        for layer in range(family_model.num_layers):
            proj = output_projection(model, layer)
            proj.weight.zero_()
            if proj.bias is not None:
                proj.bias.zero_()
    tr = cw.trace(family_model, IDS, measures=cw.measure_names())
    _assert_finite(tr)
    assert tr.degenerate.all()
    assert tr.degenerate_heads is not None and tr.degenerate_heads.all()
    assert tr.zero_values is not None and tr.zero_values.all()
    for name in ("contribution", "intra", "relative_norm", "cosine", "vw", "vw_on", "distance"):
        assert (tr[name] == 0).all(), name
    assert (tr.bias_share == 0).all()
    assert torch.isfinite(torch.tensor(tr.summary().to_numpy(dtype=float))).all()


def test_zero_values_leave_only_the_bias():
    loaded = tiny_model("llama")  # o_proj has a bias
    model = loaded.model
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.zero_()
            layer.self_attn.v_proj.bias.zero_()
    tr = cw.trace(loaded, IDS, measures=cw.measure_names(), compute_dtype="float64")
    _assert_finite(tr)
    assert not tr.degenerate.any()
    assert tr.degenerate_heads is not None and tr.degenerate_heads.all()
    assert tr.zero_values is not None and tr.zero_values.all()
    torch.testing.assert_close(tr.bias_share, torch.ones_like(tr.bias_share))
    for name in ("contribution", "intra", "relative_norm", "cosine", "vw", "vw_on", "distance"):
        assert (tr[name] == 0).all(), name


# ---- blocks, batches, dtypes, interventions -----------------------------------------------------
def test_query_blocks_give_the_same_measures(family_model):
    # Blocks of one query change only the float32 rounding of the model's own scores.
    one = cw.trace(family_model, IDS, measures="all", compute_dtype="float64")
    tiny = cw.trace(family_model, IDS, measures="all", compute_dtype="float64", block_bytes=1)
    for name in one.measures:
        torch.testing.assert_close(tiny[name].tensor(), one[name].tensor(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tiny.bias_share, one.bias_share, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_query_blocks_float32(family):
    # In float32 the L1 differences of the distance measure amplify that rounding most.
    loaded = tiny_model(family)
    one = cw.trace(loaded, IDS, measures="all")
    tiny = cw.trace(loaded, IDS, measures="all", block_bytes=1)
    for name in one.measures:
        torch.testing.assert_close(tiny[name].tensor(), one[name].tensor(), rtol=1e-5, atol=1e-4)


def test_block_bytes_bounds_the_blocks():
    loaded = tiny_model("qwen2")
    per_row = 1 * 4 * len(IDS) * 8  # B · H · T_k · 8 bytes (sized for float64 measures)
    for block_bytes, rows in [(1, 1), (3 * per_row, 3), (10**9, len(IDS))]:
        rec = Recorder()
        with torch.no_grad(), capturing(loaded.model, [rec], block_bytes=block_bytes) as session:
            loaded.model(input_ids=IDS[None], use_cache=False)
        sizes = [p.shape[2] for p in rec.probs[0]]
        assert max(sizes) == rows and sum(sizes) == len(IDS)
        assert sorted(set(session.layers_seen)) == list(range(loaded.num_layers))


def test_batch_dimension(family_model):
    batch = torch.stack([_ids(1), _ids(2), _ids(3)])
    run = eager_run(family_model.model, batch)
    rec, blocked = Recorder(), Recorder()
    with torch.no_grad(), capturing(family_model.model, [rec]):
        logits = family_model.model(input_ids=batch, use_cache=False).logits
    assert torch.equal(logits, run.logits)
    with torch.no_grad(), capturing(family_model.model, [blocked], block_bytes=3 * 4 * 11 * 8 * 3):
        family_model.model(input_ids=batch, use_cache=False)
    names = [*MEASURES, "distance"]
    for layer in range(family_model.num_layers):
        ok = allowed(batch.shape[1], window(family_model.model, layer))
        assert len(blocked.measures[layer]) == 4  # blocks of 3 queries of the whole batch
        for b in range(batch.shape[0]):
            ref = run.layer(layer, b, ok)
            for name in names:
                assert_close_rel(rec.joined(layer, name)[b], ref[name], 1e-5, f"{name} b={b}")
                got = blocked.joined(layer, name)[b]
                torch.testing.assert_close(got, ref[name], rtol=1e-5, atol=5e-6)
            got = rec.joined(layer, "bias_share")[b]
            torch.testing.assert_close(got, ref["bias_share"], rtol=0, atol=1e-10)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2"])
def test_bf16_model_gives_float32_measures(family):
    loaded = tiny_model(family, dtype=torch.bfloat16)
    tr = cw.trace(loaded, IDS, measures="all")
    assert tr.meta["model_dtype"] == "bfloat16"
    for name, t in ((n, tr[n].tensor()) for n in tr.measures):
        assert t.dtype == torch.float32, name
        assert torch.isfinite(t).all(), name
    intra_sum = tr["intra"].sum(-1)
    torch.testing.assert_close(intra_sum, torch.ones_like(intra_sum), rtol=0, atol=1e-4)
    c_sum = tr["contribution"].sum(dim=(1, 3))
    torch.testing.assert_close(c_sum, 1 - tr.bias_share, rtol=0, atol=1e-4)
    run = eager_run(loaded.model, IDS[None])  # bf16 inputs, float64 maths
    ref = run.layer(0, 0, allowed(len(IDS), window(loaded.model, 0)))
    assert_close_rel(tr["attention"][0], ref["attention"], 1e-6, "bf16 attention")
    assert_close_rel(tr["contribution"][0], ref["contribution"], 1e-3, "bf16 contribution")


class ScaleColumns:
    """Intervention: multiply attention column ``key`` of head ``head`` by ``factor``."""

    def __init__(self, layer: int, head: int, key: int, factor: float) -> None:
        self.layer, self.head, self.key, self.factor = layer, head, key, factor

    def column_scale(self, call: LayerCall) -> torch.Tensor | None:
        if call.layer_idx != self.layer:
            return None
        scale = torch.ones(call.batch, call.num_heads, call.k_len)
        scale[:, self.head, self.key] = self.factor
        return scale


def test_intervention_removes_a_projected_value():
    loaded = tiny_model("llama")
    model = loaded.model
    clean = eager_run(model, IDS[None])
    hooked: dict[int, torch.Tensor] = {}
    proj = output_projection(model, 0)
    handle = proj.register_forward_hook(lambda _m, _i, out: hooked.__setitem__(0, out.detach()))
    rec = Recorder()
    try:
        with torch.no_grad(), capturing(model, [rec], intervention=ScaleColumns(0, 1, 2, 0.0)):
            model(input_ids=IDS[None], use_cache=False)
    finally:
        handle.remove()
    probs = torch.cat(rec.probs[0], dim=2)[0]
    expected = clean.probs[0][0].clone()
    expected[1, :, 2] = 0
    assert torch.equal(probs, expected)  # no renormalisation (method §4)
    ref = clean.layer(0, 0, allowed(len(IDS), None))
    w_h = clean.weights[0][:, 1 * 8 : 2 * 8].double()  # head 1 of d_h = 8 (hidden 32, 4 heads)
    removed = clean.probs[0][0][1, :, 2, None].double() * (w_h @ clean.values[0][0][0, 2].double())
    torch.testing.assert_close(hooked[0][0].double(), ref["output"] - removed, rtol=1e-5, atol=1e-6)

    with torch.no_grad(), capturing(model, intervention=ScaleColumns(0, 1, 2, 1.0)):
        same = model(input_ids=IDS[None], use_cache=False).logits
    assert torch.equal(same, clean.logits)


class PerItemRemoval:
    """Intervention: batch item b removes key ``keys[b]`` from every head of every layer."""

    def __init__(self, keys: list[int]) -> None:
        self.keys = keys

    def column_scale(self, call: LayerCall) -> torch.Tensor:
        scale = torch.ones(call.batch, call.num_heads, call.k_len)
        for b, key in enumerate(self.keys):
            scale[b, :, key] = 0
        return scale


@pytest.mark.parametrize("family", ["qwen3", "gpt_neox"])
def test_batched_interventions_equal_one_at_a_time(family):
    """Configurations of one sequence as a batch (how faithfulness runs) == one by one."""
    model = tiny_model(family).model
    keys = [0, 3, 7]
    with torch.no_grad(), capturing(model, intervention=PerItemRemoval(keys)):
        batched = model(input_ids=IDS[None].repeat(3, 1), use_cache=False).logits
    for b, key in enumerate(keys):
        with torch.no_grad(), capturing(model, intervention=PerItemRemoval([key])):
            single = model(input_ids=IDS[None], use_cache=False).logits
        torch.testing.assert_close(batched[b], single[0], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(batched[0], batched[1])


# ---- one view per block, shared by every observer -------------------------------------------
class KeepViews:
    """A test observer: reads each block's float64 tensors, keeps the view and a weak
    reference to the tensors (not the tensors themselves)."""

    def __init__(self) -> None:
        self.views: list[LayerBlock] = []
        self.tensors: list[weakref.ref] = []

    def observe(self, view: LayerBlock) -> None:
        lt = view.tensors(torch.float64)
        assert view.tensors(torch.float64) is lt  # cached for the block
        _ = lt.output_dot_values_per_norm2  # an intermediate a second observer reuses
        self.views.append(view)
        self.tensors.append(weakref.ref(lt))


def _count_builds(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, torch.dtype]]:
    builds: list[tuple[int, int, torch.dtype]] = []
    build = LayerCall.layer_tensors

    def counting(self: LayerCall, rows: slice, probs: torch.Tensor, dtype, **kw):
        builds.append((self.layer_idx, rows.start, dtype))
        return build(self, rows, probs, dtype, **kw)

    monkeypatch.setattr(LayerCall, "layer_tensors", counting)
    return builds


def test_observers_of_a_block_share_one_layer_tensors(monkeypatch):
    """Two observers of one capture are shown the same LayerBlock per layer and block of
    queries, and one LayerTensors is built for both; after its block a view's cache is
    gone (the tensors are freed, and asking for them again is an error)."""
    loaded = tiny_model("llama")
    builds = _count_builds(monkeypatch)
    a, b = KeepViews(), KeepViews()
    per_row = 1 * 4 * len(IDS) * 8
    with torch.no_grad(), capturing(loaded.model, [a, b], block_bytes=4 * per_row):
        loaded.model(input_ids=IDS[None], use_cache=False)
    blocks = loaded.num_layers * -(-len(IDS) // 4)  # blocks of 4 queries
    assert len(a.views) == len(b.views) == blocks
    assert len(builds) == blocks  # one per block, not one per observer and block
    assert sorted(builds) == sorted(set(builds))
    assert all(x is y for x, y in zip(a.views, b.views, strict=True))
    gc.collect()
    assert all(ref() is None for ref in a.tensors)  # dropped with the block
    view = a.views[0]
    assert not view.is_open
    with pytest.raises(BlockClosedError, match="block is over"):
        view.tensors(torch.float64)


def test_the_library_observers_share_one_layer_tensors_per_block(monkeypatch):
    """The trace recorder, the geometry accumulator and the KV statistics observer, run
    in one capture in the same dtype, build one LayerTensors per block between them, and
    give what each gives alone."""
    from contribution_weights.experiments.geometry import GeometryAccumulator
    from contribution_weights.kv.scoring import StatsObserver
    from contribution_weights.tracing.recorder import TraceRecorder

    loaded = tiny_model("qwen2")
    layers = list(range(loaded.num_layers))

    def observers():
        return [
            TraceRecorder(["contribution"], layers, len(IDS), torch.float32),
            GeometryAccumulator(loaded.num_layers, loaded.num_heads, ["entropy"]),
            StatsObserver(set(layers), window=len(IDS)),  # the window is the whole block
        ]

    def run(obs):
        geometry = [o for o in obs if isinstance(o, GeometryAccumulator)]
        for o in geometry:
            o.begin_sequence(len(IDS))
        with torch.no_grad(), capturing(loaded.model, obs):
            loaded.model(input_ids=IDS[None], use_cache=False)
        for o in geometry:
            o.end_sequence()

    alone = [observers() for _ in range(3)]
    for i, obs in enumerate(alone):
        run([obs[i]])
    builds = _count_builds(monkeypatch)
    together = observers()
    run(together)
    assert len(builds) == loaded.num_layers  # one block per layer here
    for key, value in alone[0][0].vectors.items():
        assert torch.equal(together[0].vectors[key], value), key
    for name, stat in alone[1][1].stats.items():
        got = together[1].stats[name]
        assert np.array_equal(got.total, stat.total) and np.array_equal(got.count, stat.count)
    for layer, stats in alone[2][2].stats(0).items():
        got = together[2].stats(0)[layer]
        assert torch.equal(got.window_contribution, stats.window_contribution)
        assert torch.equal(got.projected_value_norm, stats.projected_value_norm)


class _Layer0:
    """A test observer that wants layer 0 only and records what it is shown."""

    def __init__(self) -> None:
        self.observed: set[int] = set()
        self.skipped_layers: set[int] = set()

    def wants(self, layer_idx: int) -> bool:
        return layer_idx == 0

    def observe(self, view: LayerBlock) -> None:
        self.observed.add(view.layer_idx)

    def skipped(self, call: LayerCall) -> None:
        self.skipped_layers.add(call.layer_idx)


@pytest.mark.parametrize("kernel", [None, "eager"])
def test_an_observer_is_shown_only_the_layers_it_wants_on_every_path(kernel):
    """On sdpa (the default) and on the eager path (kernel="eager") alike, a layer the
    observer does not want is not shown to it, and it is told the layer was skipped."""
    model = tiny_model("llama").model
    obs = _Layer0()
    with torch.no_grad(), capturing(model, [obs], kernel=kernel):
        model(input_ids=IDS[None], use_cache=False)
    layers = set(range(model.config.num_hidden_layers))
    assert obs.observed == {0} and obs.skipped_layers == layers - {0}


def test_a_nested_capture_keeps_the_outer_kernel():
    model = tiny_model("llama").model
    with torch.no_grad():
        eager = eager_logits(model, IDS[None])
        with capturing(model, kernel="eager"), capturing(model) as inner:
            got = model(input_ids=IDS[None], use_cache=False).logits
    assert inner.kernel == "eager" and torch.equal(got, eager)
