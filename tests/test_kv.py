"""KV-cache compression (contribution_weights.kv) on tiny random models, in float64.

The reference for continuing on a compressed cache is independent of the gathering code:
the model runs the continuation on the *uncompressed* prefill cache (default positions)
through an eager float64 attention function that hides, per layer and KV head, the
prefill keys that were evicted. Its logits must equal those computed on the compressed
cache, whose positions are passed explicitly to continue at the prefill length.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pandas as pd
import pytest
import torch
from reference import eager_run, reference_layer
from reference_kv import evicted_entries, greedy_tokens, reference_attention, reference_logits
from tiny_models import tiny_model
from torch import Tensor, nn

from contribution_weights import kv
from contribution_weights.kv import cache_keyword
from contribution_weights.kv.evaluate import continuation_nll
from contribution_weights.presentation.figures import plot

FAMILIES = ["llama", "qwen2", "gemma3_text", "gpt2", "phi3"]  # qwen2/llama/gemma3: GQA
T, N, WINDOW = 24, 6, 8


def _ids(length: int, seed: int) -> Tensor:
    return torch.randint(0, 99, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request: Any) -> Any:
    return tiny_model(request.param, dtype=torch.float64)


@pytest.mark.parametrize("method", ["contribution_sinks", "snapkv", "tova", "random", "knorm"])
def test_continuation_matches_attention_over_kept_entries(tiny: Any, method: str) -> None:
    ids = _ids(T + N, seed=3)
    pre = kv.prefill(tiny, ids[:, :T], window=WINDOW)
    small = kv.compress(pre, method, 0.5)
    with torch.no_grad():
        got = small.forward(tiny.model, ids[:, T:]).logits
    drop = {}
    for layer, kept in small.kept.items():
        evicted = torch.ones(*kept.shape[:2], T, dtype=torch.bool)
        evicted.scatter_(2, kept, False)
        drop[layer] = evicted
    want = reference_logits(tiny.model, pre.cache, ids[:, T:], drop)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    # and the eviction mattered: the uncompressed continuation differs
    full = reference_logits(tiny.model, pre.cache, ids[:, T:], {})
    assert (full - got).abs().max() > 1e-4


@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.9])
def test_each_method_keeps_exactly_the_requested_entries_per_head(tiny: Any, ratio: float) -> None:
    pre = kv.prefill(tiny, _ids(T, seed=4), window=WINDOW)
    want = max(1, int(T * (1 - ratio)))
    for method in kv.method_names():
        if kv.get_method(method).head_adaptive:
            continue  # per-head counts differ by design: tests/test_kv_adakv.py
        small = kv.compress(pre, method, ratio)
        assert small.kept, method
        for layer, kept in small.kept.items():
            assert kept.shape[-1] == want, (method, layer)
            assert small.cache.layers[layer].keys.shape[-2] == want
            assert small.cache.layers[layer].values.shape[-2] == want
            assert all(row.unique().numel() == want for row in kept.reshape(-1, want))
            assert bool((kept.diff(dim=-1) > 0).all())  # ascending, original order
        assert pre.cache.layers[next(iter(small.kept))].keys.shape[-2] == T  # untouched


def test_ratio_zero_is_bit_identical(tiny: Any) -> None:
    ids = _ids(T + N, seed=5)
    pre = kv.prefill(tiny, ids[:, :T], window=WINDOW)
    small = kv.compress(pre, "contribution", 0.0)
    for a, b in zip(small.cache.layers, pre.cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    plain = copy.deepcopy(pre.cache)
    with torch.no_grad():
        out = tiny.model(input_ids=ids[:, T:], **{cache_keyword(tiny.model): plain}).logits
    nll_plain = continuation_nll(out[:, :-1], ids[:, T + 1 :])
    zero = small.forward(tiny.model, ids[:, T:]).logits
    nll_zero = continuation_nll(zero[:, :-1], ids[:, T + 1 :])
    assert nll_plain == nll_zero


def test_stats_match_eager_reference(tiny: Any) -> None:
    ids = _ids(T, seed=6)
    pre = kv.prefill(tiny, ids, window=WINDOW)
    run = eager_run(tiny.model, ids)
    valid = torch.ones(T, T, dtype=torch.bool).tril()
    for layer, stats in pre.stats.items():
        probs = run.probs[layer][0]
        ref = reference_layer(
            probs[:, T - WINDOW :], run.values[layer][0], run.weights[layer],
            run.biases[layer], valid[T - WINDOW :],
        )  # fmt: skip
        torch.testing.assert_close(stats.attn_sum[0], probs.sum(1), rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(stats.window_probs[0], probs[:, T - WINDOW :])
        torch.testing.assert_close(
            stats.window_contribution[0], ref["contribution"].abs().sum(1), rtol=1e-9, atol=1e-12
        )


@pytest.mark.parametrize("family", ["qwen2", "gemma3_text", "gemma2"])
def test_generate_on_a_compressed_cache_matches_a_manual_greedy_loop(family: str) -> None:
    """Gemma's first layer slides and is not compressed, so it holds more entries than the
    compressed layers: generate must still feed the model exactly the new tokens (it once
    fed some placeholders as tokens there)."""
    model = tiny_model(family, dtype=torch.float64)
    ids = _ids(T + 3, seed=7)
    pre = kv.prefill(model, ids[:, :T], window=WINDOW)
    small = kv.compress(pre, "contribution_sinks", 0.5)
    fed: list[int] = []
    inner = model.model.model
    real_forward = inner.forward

    def spy(*args: Any, **kwargs: Any) -> Any:
        fed.append(kwargs["input_ids"].shape[1])
        return real_forward(*args, **kwargs)

    inner.forward = spy
    try:
        gen = small.generate(model.model, ids[:, T:], max_new_tokens=5, do_sample=False)
    finally:
        del inner.forward
    assert fed == [3, 1, 1, 1, 1]  # the new tokens, then one generated token a step
    manual = kv.compress(pre, "contribution_sinks", 0.5)
    assert torch.equal(gen, greedy_tokens(manual, model.model, ids[:, T:], 5))


def test_new_tokens_may_be_one_row_of_ids() -> None:
    """``(n,)`` ids are one row, as ``encode`` returns them; other shapes are refused."""
    model = tiny_model("qwen2", dtype=torch.float64)
    ids = _ids(T + 3, seed=3)
    pre = kv.prefill(model, ids[:, :T], window=WINDOW)
    one, two = (kv.compress(pre, "snapkv", 0.5) for _ in range(2))
    a = one.forward(model.model, ids[0, T:]).logits
    b = two.forward(model.model, ids[:, T:]).logits
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"\(batch, n\) or \(n,\)"):
        one.forward(model.model, ids[:, T:, None])
    with pytest.raises(ValueError, match="n >= 1"):
        one.generate(model.model, ids[0, :0], max_new_tokens=2)


def test_reserved_layers_grow_in_place_and_equal_concatenation() -> None:
    """Generation writes new keys and values into reserved room instead of concatenating
    (which copies the whole cache at every token); the contents are the concatenation's,
    past the reserved room too, and after the keys were replaced from outside (a crop)."""
    from transformers.cache_utils import DynamicLayer

    from contribution_weights.kv.cache import reserve

    torch.manual_seed(0)
    plain, cache = DynamicLayer(), type("Cache", (), {})()
    k0, v0 = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)
    plain.update(k0, v0)
    cache.layers = [plain]
    reserve(cache, 3)
    layer = cache.layers[0]
    assert layer is not plain and isinstance(layer, DynamicLayer)
    room = layer.room[0].data_ptr()
    ref_k, ref_v = k0, v0
    for m in (2, 1, 6):  # 3 fit in the room; 6 more make it grow
        k, v = torch.randn(2, 3, m, 4), torch.randn(2, 3, m, 4)
        keys, values = layer.update(k, v)
        ref_k, ref_v = torch.cat([ref_k, k], -2), torch.cat([ref_v, v], -2)
        assert torch.equal(keys, ref_k) and torch.equal(values, ref_v)
        assert layer.get_seq_length() == ref_k.shape[-2]
        if m < 6:
            assert layer.room[0].data_ptr() == room  # written in place
    layer.keys, layer.values = layer.keys[..., :4, :], layer.values[..., :4, :]  # a crop
    k, v = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
    keys, values = layer.update(k, v)
    assert torch.equal(keys, torch.cat([ref_k[..., :4, :], k], -2))
    assert torch.equal(values, torch.cat([ref_v[..., :4, :], v], -2))


def _crop_stack_reset(model: Any, pre: Any, ids: Tensor) -> tuple[list[Tensor], list[int]]:
    """Generate, crop, generate again, stack the result with a copy of itself and generate."""
    from contribution_weights.kv import cache as kv_cache

    small = kv.compress(pre, "snapkv", 0.5)
    outs = [small.generate(model.model, ids, max_new_tokens=3, do_sample=False)]
    small.cache.crop(-2)  # as transformers' assisted decoding does at its end
    outs.append(small.generate(model.model, ids[:, :1], max_new_tokens=3, do_sample=False))
    lengths = [small.cache.get_seq_length()]
    twin = copy.copy(small)
    twin.cache = copy.deepcopy(small.cache)
    stacked = kv_cache.stack_caches([small, twin])  # shallow copies of the first's layers
    outs.append(
        stacked.generate(model.model, ids[:, :1].expand(2, -1), max_new_tokens=2, do_sample=False)
    )
    lengths.append(stacked.cache.get_seq_length())
    return outs, lengths


def test_reserved_generation_equals_concatenation_after_crops_and_stacks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Keys set from outside between generations (a crop, a stacked copy) are adopted:
    every output and length equals the plain concatenating cache's."""
    from contribution_weights.kv import cache as kv_cache

    model = tiny_model("llama", dtype=torch.float64)
    ids = _ids(T + 2, seed=12)
    pre = kv.prefill(model, ids[:, :T], window=WINDOW)
    reserved = _crop_stack_reset(model, pre, ids[:, T:])
    monkeypatch.setattr(kv_cache, "reserve", lambda cache, extra: None)
    plain = _crop_stack_reset(model, pre, ids[:, T:])
    assert reserved[1] == plain[1]
    for a, b in zip(reserved[0], plain[0], strict=True):
        assert torch.equal(a, b)


def test_generating_twice_on_one_cache_continues_it() -> None:
    """A second generate on the cache the first one grew (its room made larger) gives
    the tokens of one step-by-step greedy loop."""
    model = tiny_model("llama", dtype=torch.float64)
    ids = _ids(T + 2, seed=11)
    pre = kv.prefill(model, ids[:, :T], window=WINDOW)
    small = kv.compress(pre, "snapkv", 0.5)
    first = small.generate(model.model, ids[:, T:], max_new_tokens=3, do_sample=False)
    second = small.generate(model.model, first[:, -1:], max_new_tokens=4, do_sample=False)
    tokens = greedy_tokens(kv.compress(pre, "snapkv", 0.5), model.model, ids[:, T:], 7)
    assert torch.equal(first, tokens[:, :5])
    assert torch.equal(second[:, 1:], tokens[:, 5:])


def test_sink_protection_keeps_sinks() -> None:
    model = tiny_model("llama", dtype=torch.float64)
    pre = kv.prefill(model, _ids(T, seed=8), window=WINDOW)
    small = kv.compress(pre, "contribution_sinks", 0.75)  # keeps 6 of 24
    for kept in small.kept.values():
        for row in kept.reshape(-1, kept.shape[-1]).tolist():
            assert {0, 1, 2, 3} <= set(row)


@pytest.mark.parametrize("ratio", [-0.1, 1.0, 1.5, float("nan"), "half"])
def test_bad_ratio_is_a_clear_error(ratio: Any) -> None:
    model = tiny_model("llama")
    pre = kv.prefill(model, _ids(T, seed=9), window=WINDOW)
    with pytest.raises(ValueError, match=r"compression ratio .*\[0, 1\)"):
        kv.compress(pre, "h2o", ratio)


def test_bad_method_is_a_clear_error() -> None:
    model = tiny_model("llama")
    pre = kv.prefill(model, _ids(T, seed=9), window=WINDOW)
    with pytest.raises(
        ValueError, match=r"unknown KV-cache method 'nope'; valid KV-cache methods: .*h2o"
    ):
        kv.compress(pre, "nope", 0.5)
    with pytest.raises(ValueError, match="unknown KV-cache method"):
        kv.resolve_methods("h2o,nope")


def test_kv_eval_runs_resumes_and_summarises(tmp_path: Any) -> None:
    from contribution_weights.experiments.kv_eval import KVEvalOptions, KVEvalResult, kv_eval

    model = tiny_model("llama")
    opts = KVEvalOptions(
        task="passkey", methods="contribution_sinks,h2o", ratios=[0, 0.5], context_tokens=256,
        n=3, window=8,
    )  # fmt: skip
    first = kv_eval(model, options=opts, out=tmp_path / "run", progress=False)
    assert list(first.summary.columns) == [
        "method", "task", "ratio", "n", "accuracy_mean", "accuracy_se", "compress_s", "kept_mib"
    ]  # fmt: skip
    # cost beside quality: half the entries kept is half the bytes (one cache dtype)
    mib = first.summary.set_index(["method", "ratio"])["kept_mib"]
    for method in ("contribution_sinks", "h2o"):
        assert mib[(method, 0.5)] == pytest.approx(mib[("none", 0.0)] / 2, rel=0.02)
    assert (first.summary["compress_s"] >= 0).all()
    assert set(zip(first.summary["method"], first.summary["ratio"], strict=True)) == {
        ("none", 0.0), ("contribution_sinks", 0.5), ("h2o", 0.5)
    }  # fmt: skip
    assert (first.summary["n"] == 3).all()
    info_path = tmp_path / "run" / "run_info.json"
    info = json.loads(info_path.read_text())
    assert info["finished"] is True and info["units"] == {"kv-eval": 3} and info["seconds"] >= 0
    info["seconds"] = 1000.0  # as if the first session had run that long
    info_path.write_text(json.dumps(info))
    again = kv_eval(model, options=opts, out=tmp_path / "run", resume=True, progress=False)
    assert len(again.per_item) == len(first.per_item) == 9  # nothing redone, nothing lost
    assert 1000.0 <= json.loads(info_path.read_text())["seconds"] < 1100  # sessions add up
    pd.testing.assert_frame_equal(again.summary, first.summary, check_dtype=False)
    loaded = KVEvalResult.load(tmp_path / "run")
    pd.testing.assert_frame_equal(loaded.summary, first.summary, check_dtype=False)
    assert (tmp_path / "run" / "summary_depth.csv").exists()
    assert (tmp_path / "run" / "summary_paired.csv").exists()
    fig = plot(first)  # passkey: accuracy against ratio, and against depth at ratio 0.5
    assert len(fig.axes) == 2 and fig.axes[1].get_xlabel().startswith("needle depth")
    depths = sorted(first.per_item["depth"].unique())
    lines = {c.get_label(): c for c in fig.axes[1].containers}
    assert set(lines) == {"no compression", "contribution_sinks", "h2o"}
    x, y = lines["h2o"].lines[0].get_data()
    at_half = first.by_depth().query("method == 'h2o' and ratio == 0.5").sort_values("depth")
    assert list(x) == depths and list(y) == list(at_half["accuracy_mean"])
    texts = ["abcdefghij" * 30, "klmnop" * 10, "qrstuvwxyz" * 20]
    lm = kv_eval(
        model, texts, options=KVEvalOptions(task="lm", methods="knorm", ratios=[0, 0.25],
                                             context_tokens=16, n=2, window=4),
        progress=False,
    )  # fmt: skip
    assert list(lm.summary.columns) == [
        "method", "task", "ratio", "n", "nll_mean", "nll_se", "compress_s", "kept_mib"
    ]  # fmt: skip
    assert lm.config["items_available"] == 2
    paired = lm.paired().set_index(["method", "ratio"])
    assert list(paired.columns) == ["task", "n", "delta_mean", "delta_se"]
    assert paired.loc[("none", 0.0), "delta_mean"] == 0 == paired.loc[("none", 0.0), "delta_se"]
    rows = lm.per_item.set_index(["method", "item"])["nll"]
    by_item = rows.loc["knorm"] - rows.loc["none"]
    assert paired.loc[("knorm", 0.25), "delta_mean"] == pytest.approx(by_item.mean())
    assert paired.loc[("knorm", 0.25), "delta_se"] == pytest.approx(by_item.sem())
    fig = plot(lm)
    assert len(fig.axes) == 2 and fig.axes[1].get_yscale() == "symlog"  # raw and paired panels
    with pytest.raises(ValueError, match="compression ratio"):
        KVEvalOptions(ratios=[0.5, 1.0])


def test_an_interrupted_kv_eval_keeps_its_items_and_says_it_did_not_finish(
    tmp_path: Any, monkeypatch: Any
) -> None:
    from contribution_weights.experiments.kv_eval import run as kv_module  # patched where looked up

    model = tiny_model("llama")
    opts = kv_module.KVEvalOptions(
        task="passkey", methods="h2o", ratios=[0.5], context_tokens=256, n=3, window=8
    )
    real = kv_module.item_rows
    calls: list[int] = []

    def second_interrupts(*a: Any, **k: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(kv_module, "item_rows", second_interrupts)
    with pytest.raises(KeyboardInterrupt):
        kv_module.kv_eval(model, options=opts, out=tmp_path / "run", progress=False)
    info = json.loads((tmp_path / "run" / "run_info.json").read_text())
    assert info["finished"] is False
    assert set(kv_module.KVEvalResult.load(tmp_path / "run").per_item["item"]) == {0}
    monkeypatch.setattr(kv_module, "item_rows", real)
    done = kv_module.kv_eval(model, options=opts, out=tmp_path / "run", resume=True, progress=False)
    assert done.per_item["item"].nunique() == 3
    assert json.loads((tmp_path / "run" / "run_info.json").read_text())["finished"] is True

    # a run in progress under accelerate launch: items 2 and 1 still in their processes'
    # parts (one with a line cut mid-write), item 0 merged by an earlier session and, as
    # a merge cut short leaves it, still in a part too (with other numbers: the merged
    # file's rows are the ones read)
    run = tmp_path / "run"
    lines = (run / "per_item.csv").read_text().splitlines(keepends=True)
    header, body = lines[0], lines[1:]
    of = {i: [x for x in body if x.startswith(f"{i},")] for i in range(3)}
    (run / "per_item.csv").write_text(header + "".join(of[0]))
    stale = [x[:-1] + "9\n" for x in of[0]]  # its last number changed
    for rank, rows in ((0, of[2] + stale), (1, of[1] + [of[0][0][:30]])):
        (run / "parts" / str(rank)).mkdir(parents=True)
        (run / "parts" / str(rank) / "per_item.csv").write_text(header + "".join(rows))
    live = kv_module.KVEvalResult.load(run).per_item
    pd.testing.assert_frame_equal(live, done.per_item, check_dtype=False)


def test_cli_rejects_bad_ratios_and_methods_before_loading(tmp_path: Any, capsys: Any) -> None:
    from contribution_weights.cli import main

    out = str(tmp_path / "o")
    assert main(["kv-eval", "--task", "passkey", "--ratios", "0,1.0", "--out", out]) == 2
    assert "compression ratio" in capsys.readouterr().err
    assert main(["kv-eval", "--task", "passkey", "--methods", "h2o,zzz", "--out", out]) == 2
    assert "unknown KV-cache method 'zzz'" in capsys.readouterr().err
    assert main(["kv-eval", "--task", "lm", "--out", out]) == 2
    assert "--dataset NAME or --texts" in capsys.readouterr().err


def test_kv_eval_of_one_item_warns_that_standard_errors_need_two(tmp_path, capsys, monkeypatch):
    from contribution_weights.cli import main
    from contribution_weights.experiments.kv_eval import KVEvalOptions, kv_eval
    from contribution_weights.experiments.result import FewSamplesWarning

    model = tiny_model("llama")
    opts = KVEvalOptions(task="passkey", methods="h2o", ratios=[0, 0.5], context_tokens=256,
                         n=1, window=8)  # fmt: skip
    with pytest.warns(FewSamplesWarning, match=r"only 1 item: .*accuracy_se"):
        kv_eval(model, options=opts, progress=False)
    monkeypatch.setattr("contribution_weights.loading.load_model", lambda *a, **k: model)
    capsys.readouterr()
    argv = ["kv-eval", "--task", "passkey", "--n", "1", "--methods", "h2o", "--ratios", "0,0.5",
            "--context-tokens", "256", "--out", str(tmp_path / "o")]  # fmt: skip
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "cw kv-eval: warning: only 1 item:" in err and "--n 2 or more" in err


def test_a_prefill_gathers_only_what_its_methods_need() -> None:
    model = tiny_model("llama", dtype=torch.float64)
    ids = _ids(T, seed=11)
    light = kv.prefill(model, ids, window=WINDOW, methods=["knorm", "streaming_llm"])
    for stats in light.stats.values():
        assert stats.attn_sum is None and stats.window_probs is None
        assert stats.window_contribution is None and stats.projected_value_norm is None
    full = kv.prefill(model, ids, window=WINDOW)
    for method in ("knorm", "streaming_llm"):
        a, b = kv.compress(light, method, 0.5), kv.compress(full, method, 0.5)
        assert all(torch.equal(a.kept[i], b.kept[i]) for i in a.kept)
    with pytest.raises(ValueError, match=r"did not gather attn_sum.*methods="):
        kv.compress(light, "h2o", 0.5)
    only_h2o = kv.prefill(model, ids, window=WINDOW, methods=["h2o"])
    assert all(s.attn_sum is not None and s.window_probs is None for s in only_h2o.stats.values())


def test_methods_are_parameterised_units() -> None:
    """A method's window is a field: SnapKV(window=4) on an 8-query observation window keeps
    what SnapKV keeps after a 4-query prefill; likewise contribution, whose shorter window
    the prefill sums separately."""
    model = tiny_model("qwen2", dtype=torch.float64)
    ids = _ids(T, seed=12)
    short = kv.prefill(model, ids, window=4)
    snap4 = kv.SnapKV("snapkv4", window=4, kernel=3)
    contrib4 = kv.Contribution("contribution4", window=4, sinks=2)
    wide = kv.prefill(model, ids, window=WINDOW, methods=[snap4, contrib4])
    pairs = [(snap4, kv.SnapKV("s", kernel=3)), (contrib4, kv.Contribution("c", sinks=2))]
    for unit, default in pairs:
        got, want = kv.compress(wide, unit, 0.5), kv.compress(short, default, 0.5)
        assert got.method == unit.name
        for i in want.kept:
            assert torch.equal(got.kept[i], want.kept[i]), (unit.name, i)
    with pytest.raises(ValueError, match="window=16"):
        kv.prefill(model, ids, window=WINDOW, methods=[kv.SnapKV("s16", window=16)])
    with pytest.raises(TypeError, match="description must be text"):
        kv.Method("old_style", lambda s: s.keys)  # type: ignore[arg-type]
    assert all("64" not in m.description for m in kv.METHODS)  # windows are parameters
    reverse = kv.Method.of(
        "reverse_h2o", lambda s: -s.per_kv_head(s.need("attn_sum")), "H2O upside down",
        needs=("attn_sum",),
    )  # fmt: skip
    pre = kv.prefill(model, ids, window=WINDOW, methods=[reverse])
    assert all(s.window_probs is None for s in pre.stats.values())
    flipped, h2o = kv.compress(pre, reverse, 0.5), kv.compress(pre, "h2o", 0.5)
    assert any(not torch.equal(flipped.kept[i], h2o.kept[i]) for i in h2o.kept)


def _kv_eval_cli(tmp_path: Any, methods: str, capsys: Any) -> Any:
    """``cw kv-eval`` on a tiny saved model and two texts (2 LM items of C = 128); the folder."""
    from tiny_models import save_tiny

    from contribution_weights.cli import main

    folder = save_tiny("llama", tmp_path / "model")
    texts = tmp_path / "texts.jsonl"
    lines = [json.dumps({"text": word * 60}) for word in ("abcdefghij", "klmnopqrst")]
    texts.write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    code = main(["kv-eval", "--model", str(folder), "--texts", str(texts), "--methods", methods,
                 "--ratios", "0,0.5", "--context-tokens", "128", "--n", "2",
                 "--out", str(out)])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    return out


def test_a_method_registered_from_outside_runs_in_kv_eval(tmp_path: Any, capsys: Any) -> None:
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class LastKeys(kv.Method):
        """Keep the latest keys (a test method): score = position."""

        needs = ()

        def score(self, stats: kv.LayerStats) -> Tensor:
            t = stats.length
            pos = torch.arange(t, dtype=torch.float64, device=stats.keys.device)
            return pos.expand(*stats.keys.shape[:2], t)

    kv.register_method(LastKeys("last_keys", "the most recent keys"))
    try:
        out = _kv_eval_cli(tmp_path, "last_keys,h2o", capsys)
        rows = pd.read_csv(out / "per_item.csv")
        assert set(rows["method"]) == {"none", "last_keys", "h2o"}
        assert "last_keys" in (out / "summary.csv").read_text()
    finally:
        kv.METHODS.unregister("last_keys")


def test_a_window_only_prefill_runs_on_sdpa_and_gives_the_same_stats() -> None:
    """Methods that read only the observation window: layers run on sdpa, the window's
    probabilities are eager; the statistics and kept sets equal those of the all-eager
    prefill (to the float32 rounding of eager's softmax)."""
    from contribution_weights.capture import CaptureSession

    model = tiny_model("qwen2", dtype=torch.float64)
    ids = _ids(T, seed=13)
    methods = ["snapkv", "window_attention", "contribution", "tova", "knorm"]
    calls: list[int] = []
    real = CaptureSession._sdpa

    def counting(self: Any, call: Any) -> Tensor:
        calls.append(call.layer_idx)
        return real(self, call)

    full = kv.prefill(model, ids, window=WINDOW)  # h2o and vatp need every query: eager
    CaptureSession._sdpa = counting  # type: ignore[method-assign]
    try:
        fast = kv.prefill(model, ids, window=WINDOW, methods=methods)
    finally:
        CaptureSession._sdpa = real  # type: ignore[method-assign]
    assert len(calls) == model.num_layers  # every layer on sdpa
    for layer, stats in fast.stats.items():
        ref = full.stats[layer]
        assert stats.attn_sum is None
        torch.testing.assert_close(stats.window_probs, ref.window_probs, rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(
            stats.window_contribution, ref.window_contribution, rtol=1e-6, atol=1e-8
        )
    for method in methods:
        a, b = kv.compress(fast, method, 0.5), kv.compress(full, method, 0.5)
        assert all(torch.equal(a.kept[i], b.kept[i]) for i in a.kept), method


NEW_METHODS = ["h2o_recent", "vatp_sinks", "keydiff", "criticalkv", "expected_attention"]
_queries: dict[int, tuple[Tensor, float]] = {}  # layer -> (query (B, H, T, d_h), scaling)


def _recording_attention(module: nn.Module, query: Tensor, *args: Any, **kwargs: Any) -> Any:
    scaling = kwargs.get("scaling")
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    _queries[int(module.layer_idx)] = (query.detach().clone(), scale)  # type: ignore[arg-type]
    return reference_attention(module, query, *args, **kwargs)


def _prefill_queries(model: nn.Module, ids: Tensor) -> dict[int, tuple[Tensor, float]]:
    """Every layer's queries as the attention function receives them (after RoPE), by an
    attention function of this test, independent of capture."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    name = "kv_query_recorder"
    AttentionInterface.register(name, _recording_attention)
    AttentionMaskInterface.register(name, eager_mask)
    previous = model.config._attn_implementation
    _queries.clear()
    evicted_entries.clear()
    try:
        model.set_attn_implementation(name)
        with torch.no_grad():
            model(input_ids=ids)
        return dict(_queries)
    finally:
        model.set_attn_implementation(previous)


def _group_mean(x: Tensor, g: int) -> Tensor:
    """``(H, T)`` → ``(G, T)``: the mean over each KV group's query heads."""
    return torch.stack([part.mean(0) for part in x.chunk(g, dim=0)])


def test_new_methods_match_a_direct_computation(tiny: Any) -> None:
    """h2o_recent, vatp_sinks, keydiff, criticalkv and expected_attention, each against its
    formula computed here from the eager reference's probabilities and values, the cache's
    keys and the queries an attention function of this test records."""
    from reference import projected_values

    ids = _ids(T, seed=14)
    pre = kv.prefill(tiny, ids, window=WINDOW)
    run = eager_run(tiny.model, ids)
    queries = _prefill_queries(tiny.model, ids)
    ratio = 0.5
    budget = kv.n_kept(T, ratio)  # 12 of 24
    for layer, stats in pre.stats.items():
        probs = run.probs[layer][0]  # (H, T, T)
        values = run.values[layer][0]  # (G, T, d_h)
        keys = pre.cache.layers[layer].keys[0]  # (G, T, d_h)
        g, h = keys.shape[0], probs.shape[0]
        rep = h // g
        attn = _group_mean(probs.sum(1), g)  # (G, T) Σ_i α_ij, group mean

        def kept(name: str, _layer: int = layer) -> list[set[int]]:
            rows = kv.compress(pre, name, ratio).kept[_layer][0]
            return [set(r.tolist()) for r in rows]

        # h2o_recent: the last 6 and the 6 older ones of highest accumulated attention
        for head, got in enumerate(kept("h2o_recent")):
            heavy = attn[head, : T - 6].topk(budget - 6).indices.tolist()
            assert got == set(range(T - 6, T)) | set(heavy), (layer, head)

        # vatp_sinks: Σ_i α_ij ‖v_j‖₁ after the 4 sinks, which rank above every other
        score = kv.get_method("vatp_sinks").score(stats)[0]
        want = attn * values.abs().sum(-1)
        torch.testing.assert_close(score[:, 4:], want[:, 4:], rtol=1e-9, atol=1e-12)
        assert bool((score[:, :4].min(-1).values > score[:, 4:].max(-1).values).all())
        assert all({0, 1, 2, 3} <= row for row in kept("vatp_sinks"))

        # keydiff: −cos(k_j, mean_j k_j/‖k_j‖) (a zero key, as Gemma's key norm can give,
        # scores 0: norms clamped as torch's cosine similarity does)
        norms = keys.norm(dim=-1, keepdim=True)
        anchor = (keys / norms.clamp_min(1e-12)).mean(1, keepdim=True)
        cos = (keys * anchor).sum(-1) / norms[..., 0].clamp_min(1e-8)
        want = -cos / anchor.norm(dim=-1).clamp_min(1e-8)
        torch.testing.assert_close(kv.get_method("keydiff").score(stats)[0], want)
        # with sinks (a field, as VATP's): the same scores after the first 3, which rank first
        sunk = kv.methods.KeyDiff("keydiff_3", sinks=3).score(stats)[0]
        torch.testing.assert_close(sunk[:, 3:], want[:, 3:])
        assert bool((sunk[:, :3].min(-1).values > sunk[:, 3:].max(-1).values).all())

        # criticalkv: the best 6 by snapkv, then snapkv × ‖W_O^(h) v_j‖ (group mean)
        snap = kv.get_method("snapkv").score(stats)[0]
        norm = _group_mean(projected_values(values, run.weights[layer]).norm(dim=-1), g)
        want = (snap + 1e-4) * norm
        first = snap.topk(budget // 2).indices
        for head, got in enumerate(kept("criticalkv")):
            rest = want[head].clone()
            rest[first[head]] = float("-inf")
            second = rest.topk(budget - budget // 2).indices
            assert got == set(first[head].tolist()) | set(second.tolist()), (layer, head)
        score = kv.get_method("criticalkv").score_for_budget(stats, budget)[0]
        others = torch.ones_like(want, dtype=torch.bool).scatter(1, first, False)
        torch.testing.assert_close(score[others], want[others], rtol=1e-9, atol=1e-12)

        # expected_attention: softmax_j(s μ·k_j + s²/2 k_jᵀ Σ k_j) over keys after the 4
        # sinks, μ and Σ of the window's queries, group mean, × ‖v_j‖₂
        # (the window's queries gathered by capture equal those recorded here to the float32
        # rounding of eager softmax in earlier layers; the formula is checked on the former)
        query, scale = queries[layer]
        assert stats.scaling == pytest.approx(scale, rel=1e-12)
        torch.testing.assert_close(
            stats.window_queries, query[:, :, T - WINDOW :], rtol=1e-5, atol=1e-7
        )
        window = stats.window_queries[0]  # (H, w, d_h)
        want = torch.zeros(h, T - 4, dtype=torch.float64)
        for head in range(h):
            q = window[head]
            mu = q.mean(0)
            cov = (q - mu).T @ (q - mu) / q.shape[0]
            k = keys[head // rep, 4:]
            logits = scale * k @ mu + scale**2 / 2 * torch.einsum("td,de,te->t", k, cov, k)
            want[head] = torch.softmax(logits, dim=0)
        want = _group_mean(want, g) * values[:, 4:].norm(dim=-1)
        score = kv.get_method("expected_attention").score(stats)[0]
        torch.testing.assert_close(score[:, 4:], want, rtol=1e-9, atol=1e-12)
        assert bool((score[:, :4].min(-1).values > score[:, 4:].max(-1).values).all())


def test_new_methods_keep_the_budget_and_their_protected_entries() -> None:
    model = tiny_model("qwen2", dtype=torch.float64)
    pre = kv.prefill(model, _ids(T, seed=15), window=WINDOW, methods=NEW_METHODS)
    for ratio in (0.5, 0.75, 0.95):
        budget = kv.n_kept(T, ratio)
        for name in NEW_METHODS:
            small = kv.compress(pre, name, ratio)
            for kept in small.kept.values():
                assert kept.shape[-1] == budget, (name, ratio)
                assert all(row.unique().numel() == budget for row in kept.reshape(-1, budget))
        recent = kv.get_method("h2o_recent").recent_tokens(budget)  # type: ignore[attr-defined]
        assert recent == budget // 2
        for kept in kv.compress(pre, "h2o_recent", ratio).kept.values():
            for row in kept.reshape(-1, budget).tolist():
                assert set(range(T - recent, T)) <= set(row)
        for name in ("vatp_sinks", "expected_attention"):
            for kept in kv.compress(pre, name, ratio).kept.values():
                for row in kept.reshape(-1, budget).tolist():
                    assert set(range(min(4, budget))) <= set(row) or budget < 4
    # parameters are fields; a wrapped base's statistics are gathered
    mostly_recent = kv.H2ORecent("h2o_r75", recent=0.75)
    assert mostly_recent.recent_tokens(12) == 9
    critical = kv.CriticalKV("critical_h2o", base="h2o", first_stage=0.25)
    assert set(kv.methods.method_needs(critical)) == {"attn_sum", "projected_value_norm"}
    with pytest.raises(ValueError, match="share of the budget"):
        kv.H2ORecent("bad", recent=1.5)
    light = kv.prefill(model, _ids(T, seed=15), window=WINDOW, methods=["expected_attention"])
    for stats in light.stats.values():
        assert stats.window_queries is not None and stats.window_queries.shape[2] == WINDOW
        assert stats.attn_sum is None and stats.window_probs is None
        assert stats.projected_value_norm is None and stats.window_contribution is None


def test_new_methods_are_registered_and_run_in_kv_eval(tmp_path: Any, capsys: Any) -> None:

    assert kv.resolve_methods(",".join(NEW_METHODS)) == NEW_METHODS
    out = _kv_eval_cli(tmp_path, ",".join(NEW_METHODS), capsys)
    rows = pd.read_csv(out / "per_item.csv")
    assert set(rows["method"]) == {"none", *NEW_METHODS}


def test_tables_md_shows_an_uncompressed_only_run_and_undefined_errors_as_dashes():
    """``KVEvalResult.markdown``: a run of ratio 0 only still shows its uncompressed
    accuracy; one item has no standard error (a dash, not "nan"); methods best first."""
    from contribution_weights.experiments.kv_eval import KVEvalResult

    def result(cases: list[tuple[str, float, float]]) -> KVEvalResult:
        rows = [{"item": 0, "task": "passkey", "method": m, "ratio": x, "depth": 0.1,
                 "accuracy": a, "answer_nll": 0.1, "first_token_kept": 1.0, "prefill_s": 1.0}
                for m, x, a in cases]  # fmt: skip
        return KVEvalResult(KVEvalResult.frame(rows), {"task": "passkey", "model": "tiny"})

    alone = result([("none", 0.0, 1.0)]).markdown()
    assert "Uncompressed: 1.00 ± – (n = 1)." in alone and "| method |" not in alone
    both = result([("none", 0.0, 1.0), ("h2o", 0.5, 0.0), ("snapkv", 0.5, 1.0)]).markdown()
    lines = [line for line in both.splitlines() if line.startswith("| `")]
    assert lines == ["| `snapkv` | 1.00 ± – | 0 / 0 |", "| `h2o` | 0.00 ± – | 0 / 0 |"]
    assert "nan" not in both


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_every_method_compresses_alike_on_a_gpu(family: str) -> None:
    """Every registered method scored and applied on CUDA keeps the entries it keeps on the
    CPU, and the continuation's logits agree (a float64 model, yet on an H200 the first
    method's logits differed from the CPU's by up to 1.1e-7, probably because transformers
    computes the rotary tables in float32 on each device; hence 1e-5, far below what a
    missed or wrong cache entry moves). ``random`` is left out: its seeded draw comes from the
    device's own generator. A head-adaptive method also generates the same tokens on both
    devices (padded slots, the per-head mask of :mod:`.kv.heads`)."""
    model = tiny_model(family, dtype=torch.float64)
    ids = _ids(T + N, seed=11)
    names = [m for m in kv.method_names() if m != "random"]

    def run(device: str) -> dict[tuple[str, float], Any]:
        model.model.to(device)
        x = ids.to(device)
        pre = kv.prefill(model, x[:, :T], window=WINDOW)
        out: dict[tuple[str, float], Any] = {}
        for method in names:
            for ratio in (0.25, 0.5):
                small = kv.compress(pre, method, ratio)
                with torch.no_grad():
                    logits = small.forward(model.model, x[:, T:]).logits.cpu()
                kept = {i: k.cpu() for i, k in small.kept.items()}
                out[method, ratio] = (kept, logits)
        adaptive = kv.compress(pre, "adakv_contribution", 0.5)
        out["generated", 0.5] = adaptive.generate(
            model.model, x[:, T:], max_new_tokens=4, do_sample=False
        ).cpu()
        return out

    cpu, gpu = run("cpu"), run("cuda")
    model.model.to("cpu")
    assert torch.equal(cpu["generated", 0.5], gpu["generated", 0.5])
    keys = [key for key in cpu if key[0] != "generated"]
    for key in keys:  # every kept set first: the decisions, exact
        kept_c, kept_g = cpu[key][0], gpu[key][0]
        assert kept_c.keys() == kept_g.keys(), key
        for layer in kept_c:
            assert torch.equal(kept_c[layer], kept_g[layer]), (key, layer)
    for key in keys:
        torch.testing.assert_close(gpu[key][1], cpu[key][1], rtol=1e-5, atol=1e-5, msg=str(key))


def test_the_cache_goes_under_the_keyword_the_model_reads() -> None:
    """transformers renamed ``past_key_values=`` to ``cache=``; the older releases accept a
    ``cache=`` into ``**kwargs`` and run without it, so a continuation must use the name the
    model's forward declares (here, both spellings, neither, and one behind a wrapper)."""

    class Old(nn.Module):
        def forward(self, input_ids: Tensor, past_key_values: Any = None, **kwargs: Any) -> Any:
            return past_key_values

    class New(nn.Module):
        def forward(self, input_ids: Tensor, cache: Any = None, **kwargs: Any) -> Any:
            return cache

    class Neither(nn.Module):
        def forward(self, input_ids: Tensor, **kwargs: Any) -> Any:
            return None

    assert kv.cache_keyword(Old()) == "past_key_values"
    assert kv.cache_keyword(New()) == "cache"
    model = tiny_model("llama")
    own = kv.cache_keyword(model.model)
    assert own in {"cache", "past_key_values"}
    # a wrapper that hides the name behind **kwargs gets the installed transformers' name
    assert kv.cache_keyword(Neither()) == own

    class Compiled(nn.Module):  # torch.compile's OptimizedModule keeps the model here
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self._orig_mod = inner

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return self._orig_mod(*args, **kwargs)

    assert kv.cache_keyword(Compiled(Old())) == "past_key_values"
    # the installed transformers: the compressed cache is really read (it grows)
    pre = kv.prefill(model, _ids(T, seed=1), window=WINDOW)
    small = kv.compress(pre, "snapkv", 0.5)
    before = small.cache.get_seq_length()
    small.forward(model.model, _ids(3, seed=2))
    assert small.cache.get_seq_length() == before + 3
