"""Traces at any length: streamed maps, lazy reads, derived measures, reductions without
maps, storage dtypes, the memory preflight and the first file format."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from reference import allowed, eager_run, window
from tiny_models import tiny_model

import contribution_weights as cw
from contribution_weights.measures import layer as M
from contribution_weights.measures.registry import get_measure, stored_measures
from contribution_weights.tracing import MemoryPreflightError
from contribution_weights.tracing.storage import TraceFileError

IDS = torch.tensor([5, 17, 3, 88, 42, 9, 61, 23, 7, 70, 11, 2, 40, 33, 8, 95, 14])
DERIVED = ["relative_norm", "vw", "vw_on", "ihc", "contribution", "cosine"]
EVERY = cw.measure_names()


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3_text", "gpt2"])
def test_streamed_equals_in_memory_bit_for_bit(family, tmp_path):
    lm = tiny_model(family)
    memory = cw.trace(lm, IDS, measures=EVERY, block_bytes=4 * 17 * 8 * 5)
    streamed = cw.trace(lm, IDS, measures=EVERY, block_bytes=4 * 17 * 8 * 5, out=tmp_path)
    loaded = cw.Trace.load(tmp_path)
    for tr in (streamed, loaded):
        assert tr.measures == memory.measures
        for name in EVERY:
            assert torch.equal(tr[name].tensor(), memory[name].tensor()), name
        for name, v in memory.vectors.items():
            assert torch.equal(tr.vectors[name], v), name
    # only the stored maps are on disk, as packed lower triangles
    from safetensors import safe_open

    with safe_open(str(tmp_path / "maps" / "layer-000.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(stored_measures(EVERY))
        t = len(IDS)
        assert f.get_slice("projection").get_shape() == [4, t * (t + 1) // 2]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_derived_measures_equal_computed_ones(family):
    """vw, vw_on, relative_norm and ihc read from stored maps and norms are bit for bit what
    their compute functions give on the layer's tensors."""
    lm = tiny_model(family)
    tr = cw.trace(lm, IDS, measures=EVERY, compute_dtype="float64")

    class Grab:
        def __init__(self) -> None:
            self.got: dict[int, dict[str, torch.Tensor]] = {}

        def observe(self, view):
            lt = view.tensors(torch.float64)
            self.got[view.layer_idx] = {m: get_measure(m).compute(lt)[0] for m in DERIVED}

    grab = Grab()
    with torch.no_grad(), cw.capturing(lm.model, [grab]):
        lm.model(input_ids=IDS[None], use_cache=False)
    for pos, layer in enumerate(tr.layers):
        for name in DERIVED:
            assert torch.equal(tr[name][pos], grab.got[layer][name]), (name, layer)


def test_lazy_slices_equal_eager_slices(tmp_path):
    lm = tiny_model("mistral")
    memory = cw.trace(lm, IDS, measures=["attention", "vw", "cosine"])
    cw.trace(lm, IDS, measures=["attention", "vw", "cosine"], out=tmp_path)
    lazy = cw.Trace.load(tmp_path)
    for name in ("attention", "vw", "cosine"):
        full = memory[name].tensor()
        m = lazy[name]
        assert m.shape == full.shape
        for index in [
            (1, 2),
            (0, slice(1, 3), slice(4, 9), slice(2, 7)),
            (slice(None), 0, 5),
            (-1, -1, -1, 0),
            (Ellipsis, 0),
            (0, slice(None, None, 2), slice(10, 3, -2)),
            (slice(0, 0),),
        ]:
            want = torch.from_numpy(np.array(full.numpy()[index]))  # numpy: negative steps too
            assert torch.equal(m[index], want), (name, index)
        assert torch.equal(lazy.layer(lazy.layers[1])[name], full[1])
    with pytest.raises(TypeError, match="tensor"):
        lazy["attention"][[0, 1]]


def test_reads_touch_only_the_rows_asked_for(tmp_path, monkeypatch):
    lm = tiny_model("llama")
    cw.trace(lm, IDS, measures=["contribution"], out=tmp_path)
    tr = cw.Trace.load(tmp_path)
    seen = []
    original = tr.maps.read

    def spy(name, pos, heads, rows):
        seen.append((name, pos, heads, rows))
        return original(name, pos, heads, rows)

    monkeypatch.setattr(tr.maps, "read", spy)
    tr["contribution"][1, 2, 5:8]
    assert seen == [("contribution", 1, slice(2, 3), slice(5, 8))]


def test_a_row_slice_past_the_end_reads_like_a_tensor_slice(tmp_path):
    lm = tiny_model("llama")
    memory = cw.trace(lm, IDS, measures=["contribution"])
    cw.trace(lm, IDS, measures=["contribution"], out=tmp_path)
    maps, t = cw.Trace.load(tmp_path).maps, len(IDS)
    full = memory["contribution"].tensor()
    for rows in (slice(t // 2, t + 64), slice(t + 3, t + 9), slice(-4, None)):
        got = maps.read("contribution", 1, slice(0, 2), rows)
        assert torch.equal(got, full[1, 0:2, rows]), rows


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_reductions_without_maps_equal_reductions_of_maps(family):
    lm = tiny_model(family)
    with_maps = cw.trace(lm, IDS, measures=EVERY, compute_dtype="float64")
    no_maps = cw.trace(lm, IDS, measures=EVERY, compute_dtype="float64", maps=False, top_k=4)
    assert not no_maps.has_maps and "contribution" not in no_maps
    with pytest.raises(KeyError, match="no maps"):
        no_maps["contribution"]
    for name in EVERY:
        a, b = with_maps.reduced(name, top_k=4), no_maps.reduced(name)
        for field in ("token_sums", "first", "row_sum", "entropy", "entropy_excl_first"):
            torch.testing.assert_close(getattr(b, field), getattr(a, field), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(no_maps.token_scores(name), with_maps.token_scores(name))
        if get_measure(name).is_weight:
            va, ka = with_maps.top_k(name, 4)
            vb, kb = no_maps.top_k(name, 4)
            torch.testing.assert_close(vb, va)
            assert torch.equal(kb < 0, ka < 0)
            # keys may differ only between equal values: read the map at them
            full = with_maps[name].tensor()
            torch.testing.assert_close(
                full.gather(-1, kb.long().clamp_min(0)).where(kb >= 0, 0), vb
            )
    torch.testing.assert_close(
        torch.tensor(no_maps.summary().to_numpy(dtype=float)),
        torch.tensor(with_maps.summary().to_numpy(dtype=float)),
        equal_nan=True,
    )


def test_reductions_match_brute_force():
    lm = tiny_model("qwen2")
    tr = cw.trace(lm, IDS, measures=["attention", "contribution"], maps=False, top_k=3)
    ref = cw.trace(lm, IDS, measures=["attention", "contribution"])
    t = len(IDS)
    for name in ("attention", "contribution"):
        w = ref[name].tensor()
        scores = torch.stack([w[..., i:, i].mean(-1) for i in range(t)], dim=-1)
        torch.testing.assert_close(tr.token_scores(name), scores)
        values, keys = tr.top_k(name, 3)
        rank = w.abs() if get_measure(name).signed else w
        for q in (0, 1, 5, t - 1):
            order = rank[..., q, :].argsort(dim=-1, descending=True)[..., :3]
            assert torch.equal(
                keys[..., q, :].long(),
                torch.where(torch.arange(3) <= q, order, torch.full_like(order, -1)),
            ), (name, q)
        assert (keys[..., 0, 1:] == -1).all() and (values[..., 0, 1:] == 0).all()


def test_top_k_asks_for_more_than_kept():
    tr = cw.trace(tiny_model("llama"), IDS, measures=["attention"], maps=False, top_k=2)
    with pytest.raises(ValueError, match="top_k=5"):
        tr.top_k("attention", 5)


@pytest.mark.parametrize(("tokens", "k"), [(6, 8), (len(IDS), 4)])
def test_top_k_shape_order_and_fill_as_documented(tokens, k, tmp_path):
    """(L, H, T, k) whatever T is; |value| largest first; key −1 and value 0 in the slots
    a query cannot fill (it sees fewer keys: early queries, a sliding window, T < k); the
    same from maps, from the forward and from a reloaded reductions.safetensors."""
    lm, ids, names = tiny_model("mistral"), IDS[:tokens], ["attention", "contribution"]
    ref = cw.trace(lm, ids, measures=names, compute_dtype="float64")
    no_maps = cw.trace(lm, ids, measures=names, compute_dtype="float64", maps=False, top_k=k)
    loaded = cw.Trace.load(no_maps.save(tmp_path / "reduced"))
    n_layers, heads = len(ref.layers), ref.num_heads
    assert loaded.reductions["attention"].top_keys.shape == (n_layers, heads, tokens, k)
    for name in names:
        w = ref[name].tensor()
        rank = w.abs() if get_measure(name).signed else w
        nonzero = (rank != 0).sum(-1)  # keys of nonzero weight per query
        if tokens > 5:  # the window (5 keys) leaves the last query fewer keys than itself
            assert (nonzero[..., -1] < tokens).all()
        best = torch.zeros(n_layers, heads, tokens, k, dtype=w.dtype)
        best[..., : min(k, tokens)] = rank.sort(-1, descending=True).values[..., :k]
        for tr in (ref, no_maps, loaded):
            values, keys = tr.top_k(name, k)
            assert values.shape == keys.shape == (n_layers, heads, tokens, k)
            filled = keys >= 0
            assert torch.equal(filled, torch.arange(k) < nonzero[..., None])
            assert (values[~filled] == 0).all()
            size = values.abs()
            assert (size[..., :-1] >= size[..., 1:]).all()  # largest |value| first
            torch.testing.assert_close(size, best)
            at_keys = w.gather(-1, keys.long().clamp_min(0)).where(filled, 0)
            torch.testing.assert_close(values, at_keys)  # values keep their sign
            first = tr.top_k(name, 2)
            assert torch.equal(first[0], values[..., :2]) and torch.equal(first[1], keys[..., :2])
        wider, wider_keys = ref.top_k(name, k + 3)  # computed from the maps
        assert wider.shape == wider_keys.shape == (n_layers, heads, tokens, k + 3)
        assert torch.equal(wider_keys >= 0, torch.arange(k + 3) < nonzero[..., None])
        torch.testing.assert_close(wider[..., :k].abs(), best)
        if tokens > k:  # more keys than were kept: refused without maps
            with pytest.raises(ValueError, match=f"top_k={k + 3}"):
                loaded.top_k(name, k + 3)
        else:  # every key a query sees was kept: padded
            torch.testing.assert_close(loaded.top_k(name, k + 3)[0], wider)
    with pytest.raises(ValueError, match="0 or more"):
        ref.top_k("attention", -1)


@pytest.mark.parametrize(("dtype", "atol"), [("float16", 1e-3), ("bfloat16", 8e-3)])
def test_half_storage_within_its_stated_error(dtype, atol, tmp_path):
    lm = tiny_model("llama")
    exact = cw.trace(lm, IDS, measures=EVERY)
    half = cw.trace(lm, IDS, measures=EVERY, storage_dtype=dtype, out=tmp_path)
    assert json.loads((tmp_path / "meta.json").read_text())["storage_dtype"] == dtype
    rel = 2**-11 if dtype == "float16" else 2**-8  # half the unit in the last place
    for name in stored_measures(EVERY, getattr(torch, dtype)):
        a, b = exact[name].tensor(), half[name].tensor()
        assert b.dtype == torch.float32
        # round to nearest: |error| <= rel · |x| for normal numbers, tiny absolute below
        assert ((b - a).abs() <= rel * a.abs() + 1e-7).all(), name
    for name in EVERY:
        torch.testing.assert_close(half[name].tensor(), exact[name].tensor(), rtol=0, atol=atol)
    in_memory = cw.trace(lm, IDS, measures=["contribution"], storage_dtype=dtype)
    assert in_memory.maps.tensors["contribution"].dtype == getattr(torch, dtype)


def test_memory_preflight_refuses_before_allocating(monkeypatch, tmp_path):
    lm = tiny_model("llama")
    import contribution_weights.tracing as tracing
    import contribution_weights.tracing.run as tracing_run

    def no_forward(*args, **kwargs):
        raise AssertionError("the forward ran")

    monkeypatch.setattr(tracing_run, "_run", no_forward)
    with pytest.raises(MemoryPreflightError) as err:
        cw.trace(lm, IDS, measures="all", memory_limit=20_000)
    message = str(err.value)
    assert "17 tokens" in message and "Options that fit" in message
    with pytest.raises(MemoryPreflightError, match="trace fewer tokens"):
        cw.trace(lm, IDS, memory_limit=10)
    # the options it names do fit
    need = tracing.plan_memory(
        lm,
        len(IDS),
        ["attention"],
        2,
        maps=False,
        streamed=False,
        storage=torch.float32,
        compute=torch.float32,
        top_k=8,
        block_bytes=cw.capture.DEFAULT_BLOCK_BYTES,
        reductions=True,
    )
    assert need.maps_memory == 0 and need.reductions > 0


def test_preflight_names_the_options_that_fit():
    lm = tiny_model("llama")
    t, block = 128, 4096
    ids = torch.arange(t) % 90 + 3

    def plan(**kw):
        args = dict(maps=True, streamed=False, storage=torch.float32, reductions=False)
        args.update(kw)
        return cw.tracing.plan_memory(
            lm,
            t,
            cw.measures.registry.resolve_measures("all"),
            2,
            compute=torch.float32,
            top_k=8,
            block_bytes=block,
            **args,
        ).memory

    streamed = plan(streamed=True, reductions=True)
    no_maps = plan(maps=False, reductions=True)
    limit = int(max(streamed, no_maps) / 0.9) + 1
    assert plan() > 0.9 * limit
    with pytest.raises(MemoryPreflightError) as err:
        cw.trace(lm, ids, memory_limit=limit, block_bytes=block)
    assert "--out DIR" in str(err.value) and "--no-maps" in str(err.value)


def test_cli_preflight_exits_2(tmp_path, capsys):
    from tiny_models import save_tiny

    from contribution_weights.cli import main

    folder = save_tiny("qwen2", tmp_path / "m")
    code = main(
        [
            "trace",
            "--text",
            "Hello there",
            "--model",
            str(folder),
            "--out",
            str(tmp_path / "o"),
            "--memory-limit",
            "1k",
        ]
    )
    assert code == 2
    assert "needs about" in capsys.readouterr().err


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_trace_file_gets_the_mode_of_a_plain_open(umask, tmp_path):
    """safetensors' save_file left vectors/reductions.safetensors at 0600: every file of
    a trace folder, saved or streamed, has the mode open() gives under the umask."""
    import os
    import stat

    lm, names = tiny_model("llama"), ["attention", "contribution"]
    old = os.umask(umask)
    try:
        (tmp_path / "plain").open("w").close()
        cw.trace(lm, IDS, measures=names, out=tmp_path / "streamed")
        in_memory = cw.trace(lm, IDS, measures=names)
        in_memory.token_scores("attention")  # reductions too
        in_memory.save(tmp_path / "saved")
        cw.trace(lm, IDS, measures=names, maps=False).save(tmp_path / "reduced")
    finally:
        os.umask(old)
    want = stat.S_IMODE((tmp_path / "plain").stat().st_mode)
    assert want == 0o666 & ~umask
    for folder in ("streamed", "saved", "reduced"):
        files = [p for p in (tmp_path / folder).rglob("*") if p.is_file()]
        assert {"vectors.safetensors", "reductions.safetensors"} <= {p.name for p in files}
        for path in files:
            assert stat.S_IMODE(path.stat().st_mode) == want, (folder, path.name)


def test_cli_no_maps_and_storage_dtype(tmp_path, capsys):
    from tiny_models import save_tiny

    from contribution_weights.cli import main

    folder = save_tiny("qwen2", tmp_path / "m")
    out = tmp_path / "o"
    args = ["trace", "--text", "Hello there", "--model", str(folder), "--out", str(out)]
    assert main([*args, "--no-maps", "--top-k", "3"]) == 0
    assert not (out / "maps").exists() and (out / "reductions.safetensors").exists()
    assert not (out / "heatmaps.png").exists() and (out / "first_token_weight.png").exists()
    tr = cw.Trace.load(out)
    assert not tr.has_maps and tr.top_k("attention", 3)[1].shape[-1] == 3
    assert "reductions only" in capsys.readouterr().out
    assert main([*args, "--storage-dtype", "float16", "--overwrite"]) == 0
    assert (out / "maps").is_dir()
    tr = cw.Trace.load(out)
    assert tr.meta["storage_dtype"] == "float16" and tr.has_maps


def test_untraced_layers_run_on_sdpa_and_traced_ones_stay_exact():
    lm = tiny_model("llama")
    run = eager_run(lm.model, IDS[None])
    seen = []

    class Spy:
        def wants(self, layer):
            return layer == 1

        def skipped(self, call):
            seen.append(call.layer_idx)

        def observe(self, view):
            pass

    with torch.no_grad(), cw.capturing(lm.model, [Spy()]):
        logits = lm.model(input_ids=IDS[None], use_cache=False).logits
    assert seen == [0]
    torch.testing.assert_close(logits, run.logits, rtol=1e-5, atol=1e-5)
    tr = cw.trace(lm, IDS, measures=["attention"], layers=[1], compute_dtype="float64")
    ref = run.layer(1, 0, allowed(len(IDS), window(lm.model, 1)))
    torch.testing.assert_close(tr["attention"][0], ref["attention"], rtol=1e-5, atol=1e-6)


def test_list_of_id_lists_gives_a_list_of_traces(tmp_path):
    lm = tiny_model("llama")
    a, b = IDS[:7].tolist(), IDS[3:].tolist()
    traces = cw.trace(lm, [a, b], measures=["attention"], out=tmp_path)
    assert [t.num_tokens for t in traces] == [7, len(IDS) - 3]
    assert cw.Trace.load(tmp_path / "0001").input_ids.tolist() == b
    one = cw.trace(lm, b, measures=["attention"])
    assert torch.equal(traces[1]["attention"].tensor(), one["attention"].tensor())


def test_first_format_folders_still_load(tmp_path):
    """A folder written by version 1 (one dense trace.safetensors) loads and reads lazily."""
    from safetensors.torch import save_file

    lm = tiny_model("llama")
    tr = cw.trace(lm, IDS, measures=["attention", "contribution"])
    t = len(IDS)
    tensors = {m: tr[m].tensor().contiguous() for m in tr.measures}
    tensors |= {
        "bias_share": tr.bias_share,
        "degenerate": tr.degenerate.to(torch.uint8),
        "degenerate_heads": tr.degenerate_heads.to(torch.uint8),
        "zero_values": tr.zero_values.to(torch.uint8),
        "input_ids": tr.input_ids,
    }
    save_file(tensors, str(tmp_path / "trace.safetensors"))
    (tmp_path / "tokens.json").write_text(json.dumps({"ids": IDS.tolist(), "tokens": tr.tokens}))
    meta = {"model": "m", "layers": [0, 1], "measures": ["attention", "contribution"]}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    old = cw.Trace.load(tmp_path)
    assert old.num_tokens == t and old.num_heads == 4
    assert torch.equal(old["contribution"][1, 2, 3:9], tr["contribution"][1, 2, 3:9])
    assert old.summary().equals(tr.summary())


def test_broken_folders_name_the_file_and_the_problem(tmp_path):
    lm = tiny_model("llama")
    cw.trace(lm, IDS, measures=["attention"], out=tmp_path / "t")
    folder = tmp_path / "t"
    (folder / "tokens.json").write_text(json.dumps({"ids": [1, 2], "tokens": ["a", "b"]}))
    with pytest.raises(TraceFileError, match=r"tokens.json.*does not match"):
        cw.Trace.load(folder)
    (folder / "tokens.json").write_text("{not json")
    with pytest.raises(TraceFileError, match=r"tokens.json is not valid JSON"):
        cw.Trace.load(folder)
    (folder / "tokens.json").unlink()
    with pytest.raises(TraceFileError, match=r"tokens.json is missing"):
        cw.Trace.load(folder)
    cw.trace(lm, IDS, measures=["attention"], out=folder, overwrite=True)
    shard = folder / "maps" / "layer-001.safetensors"
    shard.write_bytes(shard.read_bytes()[:50])
    with pytest.raises(TraceFileError, match=r"layer-001.safetensors"):
        cw.Trace.load(folder)["attention"][1, 0]
    cw.trace(lm, IDS, measures=["attention"], out=folder, overwrite=True)
    vectors = folder / "vectors.safetensors"
    vectors.write_bytes(vectors.read_bytes()[:100])
    with pytest.raises(TraceFileError, match=r"vectors.safetensors.*truncated"):
        cw.Trace.load(folder)
    with pytest.raises(TraceFileError, match=r"not a folder"):
        cw.Trace.load(tmp_path / "missing")


def test_summary_json_is_strict_for_one_token(tmp_path):
    lm = tiny_model("llama")
    cw.trace(lm, IDS[:1], measures=["attention"], out=tmp_path)
    raw = (tmp_path / "summary.json").read_text()
    assert "NaN" not in raw
    assert json.loads(raw)["attention"]["entropy_excl_first"] is None


def test_retrace_into_a_folder_leaves_nothing_of_the_last_run(tmp_path):
    lm = tiny_model("llama")
    cw.trace(lm, IDS, measures=["attention", "cosine"], out=tmp_path)
    (tmp_path / "heatmaps.png").write_bytes(b"old figure")
    cw.trace(lm, IDS[:5], measures=["attention"], out=tmp_path, maps=False, overwrite=True)
    assert not (tmp_path / "heatmaps.png").exists() and not (tmp_path / "maps").exists()
    assert cw.Trace.load(tmp_path).num_tokens == 5


def test_factors_derivation_matches_layer_functions():
    """The pure derive functions reproduce the compute functions on random tensors."""
    torch.manual_seed(0)
    probs = torch.rand(1, 4, 6, 6, dtype=torch.float64).tril()
    values = torch.randn(1, 2, 6, 3, dtype=torch.float64)
    w_o = torch.randn(4, 5, 3, dtype=torch.float64)
    valid = torch.ones(6, 6, dtype=torch.bool).tril()[None]
    lt = M.LayerTensors(probs, values, w_o, None, valid)
    f = M.Factors(
        maps={
            "attention": probs[0],
            "contribution": M.contribution(lt)[0],
            "projection": M.projection(lt)[0],
        },
        value_norm=lt.value_norm[0][:, None, :],
        output_norm=lt.output_norm[0][None, :, None],
        valid=valid,
    )
    assert torch.equal(M.contribution_from(f), M.contribution(lt)[0])
    assert torch.equal(M.cosine_from(f), M.cosine(lt)[0])
    assert torch.equal(M.ihc_from_factor(f), M.ihc(lt)[0])
    assert torch.equal(M.vw_from(f), M.vw(lt)[0])
    assert torch.equal(M.vw_on_from(f), M.vw_on(lt)[0])
    assert torch.equal(M.relative_norm_from(f), M.relative_norm(lt)[0])
    assert torch.equal(M.ihc_from(f), M.ihc(lt)[0])


def test_exact_inputs_gives_the_all_layer_trace_bit_for_bit():
    lm = tiny_model("qwen2")
    whole = cw.trace(lm, IDS, measures=["contribution"])
    fast = cw.trace(lm, IDS, measures=["contribution"], layers=[1])
    exact = cw.trace(lm, IDS, measures=["contribution"], layers=[1], exact_inputs=True)
    assert torch.equal(exact["contribution"][0], whole["contribution"][1])
    torch.testing.assert_close(fast["contribution"][0], whole["contribution"][1])


def test_entropy_without_token_0_is_accurate_for_strong_sinks():
    """Rows with nearly all weight on token 0 (attention sinks) lose no precision in float32:
    the rest of the row is summed on its own, not as the whole row minus token 0."""
    from contribution_weights.measures import aggregates
    from contribution_weights.measures.reductions import ReductionAccumulator

    gen = torch.Generator().manual_seed(0)
    t = 64
    tail = torch.rand(2, t, t, generator=gen).tril() * 1e-5
    w = tail.clone()
    w[..., 0] = 1.0
    w = w / w.sum(-1, keepdim=True)  # 99.9% of each row on token 0
    acc = ReductionAccumulator(["attention"], 1, 2, t)
    acc.add("attention", 0, 0, w.float())
    got = acc.results["attention"].mean_entropy(exclude_first=True)
    want = float(aggregates.entropy(w.double(), exclude_first=True).mean())
    assert got == pytest.approx(want, rel=1e-5)


def test_all_can_be_extended():
    from contribution_weights.measures.registry import resolve_measures

    everything = resolve_measures("all,distance")
    assert everything[-1] == "distance" and "ihc" not in everything
    assert resolve_measures(["all"]) == resolve_measures("all")
    assert "distance" not in resolve_measures("all")


def test_cli_steps_after_a_streamed_trace_read_bounded_blocks(tmp_path, monkeypatch):
    """`cw trace --out`: the summary, summary.json and figures after the forward read no
    whole layer, nor even a whole (T, T) head: at most one block (here T*T/4 elements)
    at a time, and the summary reads no map at all (it comes from the kept reductions)."""
    from tiny_models import save_tiny

    from contribution_weights.cli import main
    from contribution_weights.tracing import maps as maps_module
    from contribution_weights.tracing import result as result_module
    from contribution_weights.tracing.storage import PackedMaps

    folder = save_tiny("qwen2", tmp_path / "m")
    out = tmp_path / "o"
    text = "The cat sat on the mat and looked at the dog, which slept by the door all day."
    reads: list[int] = []
    limit: dict[str, int] = {}
    original = PackedMaps.read

    def bounded_read(self, name, pos, heads, rows):
        got = original(self, name, pos, heads, rows)
        reads.append(got.numel())
        assert got.numel() <= limit["elements"], (name, pos, heads, rows, got.shape)
        return got

    def no_whole_map(self):
        raise AssertionError(f"the whole {self.name!r} map was loaded")

    monkeypatch.setattr(PackedMaps, "read", bounded_read)
    monkeypatch.setattr(maps_module.MeasureMap, "tensor", no_whole_map)
    t = len(cw.load_model(str(folder)).tokenizer(text)["input_ids"])
    assert t >= 16
    limit["elements"] = t * t // 4
    monkeypatch.setattr(result_module, "_READ_ELEMENTS", t * t // 4)
    args = ["trace", "--text", text, "--model", str(folder), "--out", str(out)]
    assert main([*args, "--top-k", "2"]) == 0  # top-k below the default: summary still kept
    assert (out / "heatmaps.png").exists() and (out / "first_token_weight.png").exists()
    assert reads  # the heatmaps read the maps, block by block

    # the summary (and summary.json) of a streamed trace read no map at all
    tr = cw.Trace.load(out)
    assert tr.num_tokens == t
    limit["elements"] = 0
    reads.clear()
    summary = tr.summary()
    tr.save(out)  # rewrites the metadata, summary.json included
    assert not summary.empty and not reads


def test_no_step_after_a_streamed_trace_loads_a_whole_layer(tmp_path, monkeypatch, capsys):
    """`cw trace --out` (its summary and figures), `cw report` of the folder in the long
    view and `cw verify` read a streamed trace in bounded pieces: a read of every head and
    every query of a layer at once (what costs 2.4 GB per layer of SmolLM2 at 8,192 tokens)
    fails the test. Whole-layer reads are exactly the ones that check a shard's checksum."""
    from tiny_models import save_tiny

    from contribution_weights.cli import main
    from contribution_weights.tracing.storage import PackedMaps

    whole: list[int] = []
    real_check = PackedMaps.check

    def check(self, pos):
        whole.append(pos)
        real_check(self, pos)

    monkeypatch.setattr(PackedMaps, "check", check)
    model = save_tiny("llama", tmp_path / "model")
    text = "The river rose in the spring and the town moved to the hill above it. " * 2
    out, report = tmp_path / "trace", tmp_path / "long.html"
    argv = ["trace", "--text", text[:120], "--model", str(model), "--out", str(out)]
    assert main([*argv, "--measures", "attention,contribution"]) == 0
    assert main(["report", "--trace", str(out), "--out", str(report), "--view", "long"]) == 0
    assert main(["verify", str(out)]) == 0
    assert whole == []  # no whole layer was read, so no shard was hashed on reading
    # the check itself fires on a whole-layer read
    cw.Trace.load(out)["attention"][0]
    assert whole == [0]
