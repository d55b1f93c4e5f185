"""Removal interventions and the faithfulness experiment (method §4).

Unit tier: tiny random models, brute-force float64 references. Slow tier: SmolLM2 on a
few short real texts.
"""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch
import transformers as tf
from tiny_models import CharTokenizer, tiny_model

import contribution_weights as cw
from contribution_weights.capture import capturing
from contribution_weights.experiments.faithfulness import (
    SUMMARY_COLUMNS,
    FaithfulnessResult,
    faithfulness,
)
from contribution_weights.interventions import (
    CLEAN,
    Removal,
    SequentialRemoval,
    global_thresholds,
    removal_count,
    sink_mask,
    token_logprobs,
    tracking_sinks,
)
from contribution_weights.measures.aggregates import token_scores
from contribution_weights.measures.registry import get_measure

TEXT = "the cat sat on the mat and looked at the dog"


def _ids(text: str = TEXT) -> torch.Tensor:
    return torch.tensor(CharTokenizer()(text)["input_ids"])


class FixedScale:
    """Column scales given per layer: ``{layer: (B, H, T)}``."""

    def __init__(self, scales: dict[int, torch.Tensor]):
        self.scales = scales

    def column_scale(self, call):
        return self.scales.get(call.layer_idx)


def _no_gqa_llama() -> cw.LoadedModel:
    torch.manual_seed(1)
    config = tf.LlamaConfig(
        vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
        attention_bias=True,
    )  # fmt: skip
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return cw.LoadedModel(model, CharTokenizer(), "tiny-llama-mha")


def test_column_removal_equals_zeroed_projected_value_brute_force():
    """Column j of head h times 0 == ṽ_j^(h) = W_O^(h) v_j^(h) set to 0 (v_proj output zeroed)."""
    lm = _no_gqa_llama()
    model = lm.model.double()
    ids = _ids()[None]
    t, h, dh = ids.shape[1], 4, 8
    removed = {0: [(1, 3), (2, 5), (2, 0)], 1: [(0, 7), (3, 2), (3, 10)]}  # layer: (head, token)
    scales = {}
    for layer, pairs in removed.items():
        s = torch.ones(1, h, t, dtype=torch.float64)
        for head, tok in pairs:
            s[0, head, tok] = 0
        scales[layer] = s
    with torch.no_grad(), capturing(model, intervention=FixedScale(scales)):
        ours = model(input_ids=ids).logits

    def zero_values(layer):
        def hook(_m, _inp, out):
            out = out.clone()
            for head, tok in removed[layer]:
                out[:, tok, head * dh : (head + 1) * dh] = 0
            return out

        return hook

    model.set_attn_implementation("eager")
    handles = [
        model.model.layers[i].self_attn.v_proj.register_forward_hook(zero_values(i))
        for i in removed
    ]
    try:
        with torch.no_grad():
            brute = model(input_ids=ids).logits
            clean = model.model(input_ids=ids)  # hooks on: only to keep the code path alive
    finally:
        for hd in handles:
            hd.remove()
    del clean
    torch.testing.assert_close(ours, brute, rtol=1e-10, atol=1e-10)
    with torch.no_grad():
        untouched = model(input_ids=ids).logits
    assert (untouched - brute).abs().max() > 1e-4  # the removal did something


def test_removal_count_is_ceiling_without_float_noise():
    n = torch.tensor([10, 7, 0, 1])
    assert removal_count(0.3, n).tolist() == [3, 3, 0, 1]
    assert removal_count(0.0, n).tolist() == [0, 0, 0, 0]
    assert removal_count(1.0, n).tolist() == [10, 7, 0, 1]


def _run_history(lm, removals, ids, **kw):
    inter = SequentialRemoval(removals, keep_history=True, **kw)
    with torch.no_grad(), tracking_sinks(lm.model) as sinks:
        inter.sinks = sinks
        with capturing(lm.model, intervention=inter):
            logits = lm.model(input_ids=ids[None].expand(len(removals), -1)).logits
    return inter.history, logits


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "gpt2"])
def test_sequential_scores_use_earlier_removals_and_select_top_k(model_type):
    lm = tiny_model(model_type)
    ids = _ids()
    removals = [Removal("ihc", "comprehensiveness", 0.4), Removal("vw", "sufficiency", 0.3)]
    history, logits = _run_history(lm, removals, ids)
    layers = sorted(history)
    assert layers == list(range(lm.num_layers))
    for b, r in enumerate(removals):
        scales: dict[int, torch.Tensor] = {}
        for layer in layers:
            rec = history[layer]
            # brute force: replay the earlier removals, score this layer in float64
            seen = {}

            class Probe:
                def observe(self, view, layer=layer, seen=seen, r=r):
                    if view.layer_idx == layer:
                        lt = view.tensors(torch.float64)
                        seen["w"] = get_measure(r.measure).compute(lt)[0]

            with torch.no_grad(), capturing(lm.model, [Probe()], FixedScale(dict(scales))):
                lm.model(input_ids=ids[None])
            # `scales` holds the removals of layers < layer only, so the probe sees this
            # layer's activations as the sequential pass did before removing anything here
            expected = token_scores(seen["w"])
            torch.testing.assert_close(rec.scores[b].double(), expected, rtol=1e-4, atol=1e-6)
            # top/bottom ⌈p·N⌉ eligible tokens per head, by brute-force sorting
            elig = rec.eligible[b]
            k = math.ceil(round(r.rate * int(elig.sum()), 6))
            for head in range(lm.num_heads):
                cand = [j for j in range(len(ids)) if elig[j]]
                cand.sort(key=lambda j, h=head: float(rec.scores[b, h, j]),
                          reverse=r.mode == "comprehensiveness")  # fmt: skip
                got = set(torch.nonzero(rec.removed[b, head]).flatten().tolist())
                assert got == set(cand[:k])
            scales[layer] = (~rec.removed[b : b + 1]).double()
        # the replayed removals give the same logits as the sequential pass
        with torch.no_grad(), capturing(lm.model, intervention=FixedScale(scales)):
            replay = lm.model(input_ids=ids[None]).logits[0]
        torch.testing.assert_close(replay, logits[b], rtol=1e-5, atol=1e-5)
    # and layer-1 scores are not those of the clean pass
    clean_hist, _ = _run_history(lm, [Removal("ihc", "comprehensiveness", 0.0)], ids)
    assert not torch.allclose(clean_hist[1].scores[0], history[1].scores[0])


def test_rate_zero_reproduces_clean_perplexity_exactly():
    lm = tiny_model("llama")
    res = faithfulness(lm, [TEXT, TEXT[::-1]], measures=["attention", "ihc"], rates=[0.0, 0.5],
                       progress=False)  # fmt: skip
    df = res.per_sequence
    zero = df[df.rate == 0.0]
    assert (zero.nll == zero.nll_clean).all() and (zero.delta_ppl == 0).all()
    # the clean value is the plain model's perplexity (capture off)
    with torch.no_grad():
        logits = lm.model(input_ids=_ids()[None]).logits[0]
    nll = torch.nn.functional.cross_entropy(logits[:-1].double(), _ids()[1:]).item()
    assert df[df.seq == 0].nll_clean.iloc[0] == pytest.approx(nll, rel=1e-5)
    assert (df[df.rate == 0.5].delta_nll != 0).all()


@pytest.mark.parametrize("scope", ["layer", "global"])
def test_batched_equals_one_configuration_at_a_time(scope):
    lm = tiny_model("qwen2")
    kw = dict(measures=["attention", "vw_on", "distance"], rates=[0.2, 0.6], scope=scope,
              baselines="none", progress=False)  # fmt: skip
    batched = faithfulness(lm, [TEXT], **kw).per_sequence
    single = faithfulness(lm, [TEXT], batch_size=1, **kw).per_sequence
    assert len(batched) == 3 * 2 * 2
    torch.testing.assert_close(
        torch.tensor(batched.nll.values), torch.tensor(single.nll.values), rtol=1e-5, atol=1e-6
    )


def test_sink_mask_brute_force():
    torch.manual_seed(0)
    h = torch.randn(2, 6, 8, dtype=torch.float64)
    h[0, 3] = 2.5 * h[0, 0]  # same direction as token 0
    h[1, 4] = h[1, 0] + 1e-3
    mask = sink_mask(h)
    for b in range(2):
        for j in range(6):
            cos = torch.dot(h[b, j], h[b, 0]) / (h[b, j].norm() * h[b, 0].norm())
            assert bool(mask[b, j]) == (j == 0 or bool(cos > 0.95))
    assert mask[0, 3] and mask[1, 4] and mask[:, 0].all()


def test_sinks_excluded_when_protected_and_eligible_when_not():
    lm = tiny_model("llama")
    # token 5 repeats token 0's id: identical layer-0 input (embedding), so a sink there
    ids = torch.tensor([7, 20, 31, 42, 53, 7, 64, 75, 11, 22])
    rm = [Removal("attention", "comprehensiveness", 1.0)]
    hist, _ = _run_history(lm, rm, ids, protect_sinks=True)
    assert not hist[0].eligible[0, 0] and not hist[0].eligible[0, 5]
    assert not hist[0].removed[0, :, [0, 5]].any()
    assert hist[0].removed[0, :, [1, 2, 3, 4, 6, 7, 8, 9]].all()  # rate 1: all eligible
    hist, _ = _run_history(lm, rm, ids, protect_sinks=False)
    assert hist[0].eligible[0].all() and hist[0].removed[0].all()


def test_global_thresholds_are_clean_pass_quantiles():
    lm = tiny_model("llama")
    ids = _ids()
    rm = [Removal("ihc", "comprehensiveness", 0.25), Removal("ihc", "sufficiency", 0.25), CLEAN]
    out = global_thresholds(lm.model, ids, rm)
    hist, _ = _run_history(lm, [Removal("ihc", "comprehensiveness", 0.0)], ids)
    pooled = torch.cat([rec.scores[0][:, rec.eligible[0]].reshape(-1) for rec in hist.values()])
    pooled = pooled.double()
    assert out[0].threshold == pytest.approx(torch.quantile(pooled, 0.75).item(), rel=1e-6)
    assert out[1].threshold == pytest.approx(torch.quantile(pooled, 0.25).item(), rel=1e-6)
    assert out[2].threshold is None
    # at layer 0 (no earlier removal) exactly the tokens beyond the threshold go
    hist_g, _ = _run_history(lm, out[:1], ids, scope="global")
    rec = hist_g[0]
    expect = (rec.scores[0] > out[0].threshold) & rec.eligible[0][None]
    assert torch.equal(rec.removed[0], expect)


def test_token_logprobs_checks_shapes():
    lm = tiny_model("llama")
    with pytest.raises(ValueError, match="one row per removal"):
        token_logprobs(lm, _ids()[None], [CLEAN, CLEAN])


def test_bad_options_fail_with_the_fix():
    lm = tiny_model("llama")
    with pytest.raises(ValueError, match="valid measures"):
        faithfulness(lm, [TEXT], measures=["nope"], progress=False)
    with pytest.raises(ValueError, match="mode"):
        faithfulness(lm, [TEXT], modes=["both"], progress=False)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        faithfulness(lm, [TEXT], rates=[1.5], progress=False)


def test_run_folder_files_resume_and_summary(tmp_path):
    lm = tiny_model("gpt2")
    texts = [TEXT, "a short one here", "x" * 30]
    kw = dict(measures=["attention", "ihc"], rates=[0.1, 0.5], baselines="none", progress=False)
    first = faithfulness(lm, texts[:2], out=tmp_path / "run", **kw)
    names = {p.name for p in (tmp_path / "run").iterdir()}
    assert names >= {"config.json", "per_sequence.csv", "summary.csv"}
    assert "faithfulness.png" not in names  # figures are written by the CLI (layering)
    # resume with more texts is refused (different config); same texts: nothing redone
    with pytest.raises(Exception, match="config differs"):
        faithfulness(lm, texts, out=tmp_path / "run", resume=True, **kw)
    again = faithfulness(lm, texts[:2], out=tmp_path / "run", resume=True, **kw)
    assert len(again.per_sequence) == len(first.per_sequence) == 2 * 2 * 2 * 2
    # an interrupted run: drop the second sequence's rows, resume recomputes only them
    csv = tmp_path / "run" / "per_sequence.csv"
    lines = csv.read_text().splitlines(keepends=True)
    csv.write_text("".join(lines[:9]))
    resumed = faithfulness(lm, texts[:2], out=tmp_path / "run", resume=True, **kw)
    torch.testing.assert_close(
        torch.tensor(resumed.per_sequence.delta_nll.values),
        torch.tensor(first.per_sequence.delta_nll.values),
    )
    summary = resumed.summary
    assert list(summary.columns) == SUMMARY_COLUMNS and (summary.n == 2).all()
    sub = resumed.per_sequence
    row = summary[(summary.measure == "ihc") & (summary["mode"] == "sufficiency")].iloc[1]
    vals = sub[(sub.measure == "ihc") & (sub["mode"] == "sufficiency") & (sub.rate == 0.5)]
    assert row.delta_ppl_mean == pytest.approx(vals.delta_ppl.mean())
    assert row.delta_ppl_se == pytest.approx(vals.delta_ppl.std(ddof=1) / math.sqrt(2))
    loaded = FaithfulnessResult.load(tmp_path / "run")
    assert json.loads((tmp_path / "run" / "config.json").read_text())["measures"] == [
        "attention", "ihc"
    ]  # fmt: skip
    assert len(loaded.summary) == len(summary)


def test_cli_faithfulness_on_a_text_file(tmp_path, monkeypatch):
    from contribution_weights.cli import main

    lm = tiny_model("llama")
    monkeypatch.setattr("contribution_weights.loading.load_model", lambda *a, **k: lm)
    f = tmp_path / "t.txt"
    f.write_text(TEXT + "\n\nsecond text for the run\n")
    rc = main(["faithfulness", "--file", str(f), "--measures", "attention,ihc", "--rates",
               "0.2,0.4", "--out", str(tmp_path / "o")])  # fmt: skip
    assert rc == 0
    assert (tmp_path / "o" / "summary.csv").read_text().splitlines()[0] == ",".join(SUMMARY_COLUMNS)
    assert (tmp_path / "o" / "faithfulness.png").stat().st_size > 0


@pytest.mark.slow
def test_smollm2_ihc_comprehensiveness_grows_with_rate(smollm2, shared_data):
    from contribution_weights.data import load_texts

    texts = load_texts("gsm8k", 2, shared_data)
    res = faithfulness(smollm2, texts, measures=["ihc"], rates=[0.05, 0.2, 0.5],
                       modes=["comprehensiveness"], max_tokens=48, baselines="none",
                       progress=False)  # fmt: skip
    s = res.summary.sort_values("rate")
    d = s.delta_ppl_mean.to_numpy()
    assert (d[1:] > d[:-1]).all() and d[0] > 0, s


def test_rows_are_chunked_by_memory_and_halved_on_out_of_memory(monkeypatch):
    from contribution_weights.interventions import batching as removal

    lm = tiny_model("llama")
    assert removal.auto_batch_size(lm, 40, 1) == 1
    assert removal.auto_batch_size(lm, 40, 1 << 40) > 100
    ids = _ids()[None].expand(5, -1)
    rm = [CLEAN, *[Removal("vw", "sufficiency", p) for p in (0.1, 0.3, 0.5, 0.7)]]
    full = token_logprobs(lm, ids, rm)
    sizes = []
    real = removal._forward

    def fake(model, chunk, removals, *a):
        sizes.append(chunk.shape[0])
        if chunk.shape[0] > 2:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, chunk, removals, *a)

    monkeypatch.setattr(removal, "_forward", fake)
    halved = token_logprobs(lm, ids, rm, batch_size=5)
    assert sizes == [5, 2, 2, 1]
    torch.testing.assert_close(halved, full, rtol=1e-5, atol=1e-6)


def test_resume_redoes_a_sequence_cut_mid_write(tmp_path):
    lm = tiny_model("gpt2")
    texts = [TEXT, "a short one here"]
    kw = dict(measures=["attention", "ihc"], rates=[0.1, 0.5], baselines="none", progress=False)
    first = faithfulness(lm, texts, out=tmp_path / "run", **kw)
    csv = tmp_path / "run" / "per_sequence.csv"
    lines = csv.read_text().splitlines(keepends=True)
    # header, 4 of sequence 0's 8 rows, then a half-written 5th row
    csv.write_text("".join(lines[:5]) + lines[5][:7])
    resumed = faithfulness(lm, texts, out=tmp_path / "run", resume=True, **kw)
    assert (resumed.summary.n == 2).all()
    assert sorted(resumed.per_sequence.seq.tolist()) == [0] * 8 + [1] * 8
    torch.testing.assert_close(
        torch.tensor(resumed.per_sequence.delta_nll.values),
        torch.tensor(first.per_sequence.delta_nll.values),
    )
    assert len(csv.read_text().splitlines()) == 1 + 16


def test_a_measure_or_mode_string_is_a_name_not_letters():
    lm = tiny_model("llama")
    res = faithfulness(lm, [TEXT], measures="ihc", modes="sufficiency", rates=0.5,
                       baselines="none", progress=False)  # fmt: skip
    assert res.config["measures"] == ["ihc"] and res.config["modes"] == ["sufficiency"]
    assert set(res.per_sequence["mode"]) == {"sufficiency"} and len(res.per_sequence) == 1
    modes = "comprehensiveness,sufficiency"
    both = faithfulness(lm, [TEXT], measures="attention,ihc", modes=modes, rates=[0.5],
                        baselines="none", progress=False)  # fmt: skip
    assert both.config["measures"] == ["attention", "ihc"] and len(both.per_sequence) == 4


@pytest.mark.parametrize("size", [0, -1])
def test_batch_size_below_one_is_refused(size, tmp_path, monkeypatch, capsys):
    from contribution_weights.cli import main

    lm = tiny_model("llama")
    with pytest.raises(ValueError, match="at least 1"):
        token_logprobs(lm, _ids()[None], [CLEAN], batch_size=size)
    monkeypatch.setattr("contribution_weights.loading.load_model", lambda *a, **k: lm)
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    with pytest.raises(SystemExit):
        main(["faithfulness", "--file", str(f), "--batch-size", str(size), "--out",
              str(tmp_path / "o")])  # fmt: skip
    assert "at least 1" in capsys.readouterr().err


def test_blank_and_one_token_texts_are_skipped_and_counted():
    lm = tiny_model("llama")
    res = faithfulness(lm, [TEXT, "   ", "a", "another short text"], measures=["attention"],
                       rates=[0.5], modes=["sufficiency"], baselines="none",
                       progress=False)  # fmt: skip
    assert sorted(res.per_sequence.seq) == [0, 3]
    assert [(s["unit"], s["reason"]) for s in res.run_info["skipped"]] == [
        (1, "blank text"),
        (2, "fewer than 2 tokens: no next token to score"),
    ]
    assert res.run_info["seconds"] >= 0 and "torch" in res.run_info["versions"]
    with pytest.raises(ValueError, match="at least 2"):
        faithfulness(lm, [TEXT], max_tokens=1, progress=False)


def test_probs_and_valid_of_selected_batch_rows_equal_the_full_batch_rows():
    lm = tiny_model("qwen3")  # GQA
    t = _ids().numel()
    ids = torch.stack([_ids(), _ids("a different text, at least as long as the first one")[:t]])
    ids = torch.cat([ids, ids[:1]])
    idx = torch.tensor([2, 0])
    seen = []

    class Check:
        def column_scale(self, call):
            rows = slice(3, 9)
            torch.testing.assert_close(call.probs(rows, idx), call.probs(rows)[idx], rtol=0, atol=0)
            assert torch.equal(call.valid(rows, idx), call.valid(rows)[idx])
            seen.append(call.layer_idx)
            return None

    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # a padded row gives a per-row mask
    with torch.no_grad(), capturing(lm.model, intervention=Check()):
        lm.model(input_ids=ids, attention_mask=mask, use_cache=False)
    assert seen == list(range(lm.num_layers))


def test_options_object_sets_the_sink_cosine(tmp_path, monkeypatch, capsys):
    from contribution_weights.cli import main
    from contribution_weights.experiments.faithfulness import FaithfulnessOptions

    lm = tiny_model("llama")
    # cosine > -1 holds for every token, so every token is a protected sink: nothing removed
    opts = FaithfulnessOptions(measures=["vw"], rates=[0.5], sink_cosine=-1.0)
    res = faithfulness(lm, [TEXT], options=opts, progress=False)
    assert res.config["sink_cosine"] == -1.0 and (res.per_sequence.delta_nll == 0).all()
    default = faithfulness(lm, [TEXT], measures=["vw"], rates=[0.5], progress=False)
    assert (default.per_sequence.delta_nll != 0).any()
    with pytest.raises(ValueError, match="cosine"):
        faithfulness(lm, [TEXT], sink_cosine=2.0, progress=False)
    with pytest.warns(DeprecationWarning, match="sink_cosine"):  # the older keyword
        old = faithfulness(lm, [TEXT], measures=["vw"], rates=[0.5], sink_threshold=-1.0,
                           progress=False)  # fmt: skip
    assert old.config["sink_cosine"] == -1.0
    monkeypatch.setattr("contribution_weights.loading.load_model", lambda *a, **k: lm)
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    rc = main(["faithfulness", "--file", str(f), "--measures", "vw", "--rates", "0.5",
               "--sink-cosine", "-1", "--out", str(tmp_path / "o")])  # fmt: skip
    assert rc == 0
    assert json.loads((tmp_path / "o" / "config.json").read_text())["sink_cosine"] == -1.0
    # the older flag still works, with a warning
    rc = main(["faithfulness", "--file", str(f), "--measures", "vw", "--rates", "0.5",
               "--sink-threshold", "-1", "--out", str(tmp_path / "o2")])  # fmt: skip
    assert rc == 0 and "--sink-threshold is deprecated" in capsys.readouterr().err
    assert json.loads((tmp_path / "o2" / "config.json").read_text())["sink_cosine"] == -1.0
    # the CLI and the API refuse a bad value with the same message, each naming its spelling
    rc = main(["faithfulness", "--file", str(f), "--sink-cosine", "3", "--out",
               str(tmp_path / "o3")])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and "error: --sink-cosine is a cosine, in [-1, 1]; got 3.0" in err
    with pytest.raises(ValueError, match=r"^sink_cosine is a cosine, in \[-1, 1\]; got 3.0"):
        FaithfulnessOptions(sink_cosine=3.0)


def test_cli_corpus_arguments_take_the_first_n_and_refuse_n_below_one(
    tmp_path, monkeypatch, capsys
):
    from contribution_weights.cli import main

    lm = tiny_model("llama")
    monkeypatch.setattr("contribution_weights.loading.load_model", lambda *a, **k: lm)
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps({"body": t}) + "\n" for t in [TEXT, "two", "three"]))
    args = ["faithfulness", "--texts", str(f), "--field", "body", "--measures", "attention",
            "--rates", "0.5", "--modes", "sufficiency"]  # fmt: skip
    for n in ("0", "-2"):
        with pytest.raises(SystemExit):
            main([*args, "--n", n, "--out", str(tmp_path / f"o{n}")])
        assert "at least 1" in capsys.readouterr().err
    assert main([*args, "--n", "2", "--out", str(tmp_path / "o")]) == 0
    config = json.loads((tmp_path / "o" / "config.json").read_text())
    assert config["n_texts"] == 2 and config["source"] == str(f)


def test_token_scores_by_query_blocks_equal_the_brute_force_mean():
    from contribution_weights.measures.aggregates import later_query_mean, later_query_sums

    w = torch.rand(2, 3, 7, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    brute = torch.zeros(2, 3, 7, dtype=torch.float64)
    for j in range(7):
        brute[..., j] = w[..., j:, j].mean(-1)
    torch.testing.assert_close(token_scores(w), brute)
    total = sum(later_query_sums(w[..., s : s + 3, :], s) for s in range(0, 7, 3))
    torch.testing.assert_close(later_query_mean(total, 7), brute)
    # scoring queries < 4 only (a prompt): keys j ≥ 4 have no later query and score 0
    part = later_query_mean(later_query_sums(w[..., :4, :]), 4)
    for j in range(7):
        want = w[..., j:4, j].mean(-1) if j < 4 else torch.zeros(2, 3, dtype=torch.float64)
        torch.testing.assert_close(part[..., j], want)


def test_intervened_logprobs_takes_any_intervention_per_chunk():
    from contextlib import nullcontext

    from contribution_weights.interventions import intervened_logprobs, mean_nll

    lm = tiny_model("llama")
    ids = _ids()
    t = ids.numel()
    gammas = torch.tensor([1.0, 0.0, 0.5, 2.0])

    def scale_for(rows):
        scale = torch.ones(len(gammas[rows]), lm.num_heads, t)
        scale[:, :, 0] = gammas[rows][:, None]
        return nullcontext(FixedScale(dict.fromkeys(range(lm.num_layers), scale)))

    batch = ids[None].expand(len(gammas), -1)
    whole = intervened_logprobs(lm, batch, scale_for)
    one_by_one = intervened_logprobs(lm, batch, scale_for, batch_size=1)
    torch.testing.assert_close(one_by_one, whole, rtol=1e-5, atol=1e-6)
    clean = intervened_logprobs(lm, ids[None], lambda rows: nullcontext(None))
    torch.testing.assert_close(whole[0], clean[0], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(whole[1], clean[0])
    with torch.no_grad():
        logp = torch.log_softmax(lm.model(input_ids=ids[None]).logits[0].double(), dim=-1)
    brute = -sum(float(logp[k, ids[k + 1]]) for k in range(t - 1)) / (t - 1)
    assert float(mean_nll(clean)[0]) == pytest.approx(brute, rel=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "gpt2"])
def test_column_sum_token_scores_equal_the_full_measure_tensors(model_type, monkeypatch):
    """The ranking's per-key column sums (attention, vw, vw_on, ihc) and the reuse of the
    forward's probabilities give the scores, removals and NLLs of the generic path."""
    from contribution_weights import capture
    from contribution_weights.interventions import removal as removal_module

    lm = tiny_model(model_type)
    ids = _ids()
    removals = [CLEAN, *(Removal(m, mode, 0.4) for m in ("attention", "vw", "vw_on", "ihc")
                         for mode in ("comprehensiveness", "sufficiency"))]  # fmt: skip

    def run():
        probe = SequentialRemoval(removals, keep_history=True)
        with torch.no_grad(), capturing(lm.model, intervention=probe):
            logits = lm.model(input_ids=ids[None].expand(len(removals), -1)).logits
        return probe.history, logits

    fast, fast_logits = run()
    looked_up: list[str] = []  # the slow path: no column sums (append returns None)
    monkeypatch.setattr(removal_module, "column_sums_of", lambda m: looked_up.append(m))
    monkeypatch.setattr(
        capture.LayerCall,
        "row_blocks",
        lambda self: [slice(0, self.q_len // 2), slice(self.q_len // 2, self.q_len)],
    )  # no shared probs
    slow, slow_logits = run()
    # the patch must reach the lookup, or both runs took the fast path; column sums serve
    # the layers with a mask (gemma2's sliding windows), plain causal ones (mask None) not
    if model_type == "gemma2":
        assert looked_up, "column_sums_of is looked up elsewhere: the slow path was not forced"
    for layer, rec in slow.items():
        torch.testing.assert_close(fast[layer].scores, rec.scores, rtol=1e-5, atol=1e-7,
                                   equal_nan=True)  # fmt: skip
        assert torch.equal(fast[layer].removed, rec.removed)
    torch.testing.assert_close(fast_logits, slow_logits, rtol=1e-5, atol=1e-5)


def test_cli_min_tokens_keeps_long_texts_and_join_reaches_the_length(tmp_path, monkeypatch, capsys):
    from contribution_weights.cli import main

    lm = tiny_model("llama")  # one token per character
    monkeypatch.setattr("contribution_weights.loading.load_model", lambda *a, **k: lm)
    f = tmp_path / "t.txt"
    f.write_text("short one\n\n" + "a long enough text " * 3 + "\n\nsmall\n\ntiny\n")
    args = ["faithfulness", "--file", str(f), "--measures", "attention", "--rates", "0.5",
            "--modes", "sufficiency", "--max-tokens", "20"]  # fmt: skip
    assert main([*args, "--min-tokens", "20", "--out", str(tmp_path / "a")]) == 0
    per = pd.read_csv(tmp_path / "a" / "per_sequence.csv")
    assert set(per.n_tokens) == {20} and per.seq.nunique() == 1
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["n_texts"] == 1 and "texts of ≥20 tokens" in config["source"]
    # joined: "short one" + the long text reach 20; "small" + "tiny" do not (dropped)
    assert main([*args, "--min-tokens", "20", "--join", "--out", str(tmp_path / "b")]) == 0
    per = pd.read_csv(tmp_path / "b" / "per_sequence.csv")
    assert set(per.n_tokens) == {20} and per.seq.nunique() == 1
    capsys.readouterr()
    assert main([*args, "--join", "--out", str(tmp_path / "c")]) == 2
    assert "--join needs --min-tokens" in capsys.readouterr().err
    assert main([*args, "--min-tokens", "500", "--out", str(tmp_path / "d")]) == 2
    assert "lower --min-tokens" in capsys.readouterr().err


def test_one_text_warns_that_standard_errors_need_two(tmp_path, monkeypatch, capsys):
    import warnings

    from contribution_weights.cli import main
    from contribution_weights.experiments.result import FewSamplesWarning

    lm = tiny_model("llama")
    with pytest.warns(FewSamplesWarning, match=r"only 1 text: .*delta_ppl_se.*2 or more texts"):
        res = faithfulness(lm, [TEXT], measures=["attention"], rates=[0.5], progress=False)
    assert res.summary["delta_ppl_se"].isna().all()  # what the warning is about
    with warnings.catch_warnings():
        warnings.simplefilter("error", FewSamplesWarning)  # two texts: no warning
        faithfulness(lm, [TEXT, TEXT[::-1]], measures=["attention"], rates=[0.5], progress=False)

    monkeypatch.setattr("contribution_weights.loading.load_model", lambda *a, **k: lm)
    f = tmp_path / "one.txt"
    f.write_text(TEXT + "\n")
    capsys.readouterr()
    rc = main(["faithfulness", "--file", str(f), "--measures", "attention", "--rates", "0.5",
               "--out", str(tmp_path / "o")])  # fmt: skip
    assert rc == 0
    err = capsys.readouterr().err
    assert "cw faithfulness: warning: only 1 text:" in err and "--n 2 or more" in err
    assert "UserWarning" not in err and "FewSamplesWarning" not in err  # one plain line


def test_a_folder_with_the_old_sha1_fingerprint_resumes(tmp_path):
    """Every experiment fingerprints its texts as texts_sha256; faithfulness folders written
    before hold texts_sha1 and still resume with the same texts (and only with them)."""
    import json

    from contribution_weights.runs import RunFolderError, fingerprint

    lm = tiny_model("llama")
    texts = [TEXT, TEXT[::-1]]
    kw = dict(measures=["attention"], rates=[0.5], progress=False)
    first = faithfulness(lm, texts, out=tmp_path / "r", **kw)
    config_file = tmp_path / "r" / "config.json"
    config = json.loads(config_file.read_text())
    assert config["texts_sha256"] == fingerprint(texts)
    del config["texts_sha256"]
    config["texts_sha1"] = fingerprint(texts, algorithm="sha1")  # as older versions wrote
    config_file.write_text(json.dumps(config))
    again = faithfulness(lm, texts, out=tmp_path / "r", resume=True, **kw)
    pd.testing.assert_frame_equal(again.summary, first.summary)
    with pytest.raises(RunFolderError, match="texts_sha1"):
        faithfulness(lm, [TEXT], out=tmp_path / "r", resume=True, **kw)


def test_interventions_run_end_to_end_and_older_folders_resume(tmp_path):
    """--intervention reaches the removal: key_mask and mean_value give other NLLs than
    value_zero; a folder written before the option existed resumes as value_zero."""
    import json

    import numpy as np

    from contribution_weights.experiments.options import FaithfulnessOptions

    lm = tiny_model("llama")
    chosen = dict(measures=["attention"], rates=[0.5], modes=["comprehensiveness"])
    kw = dict(chosen, progress=False)
    nll = {}
    for how in ("value_zero", "key_mask", "mean_value"):
        opts = FaithfulnessOptions(intervention=how, **chosen)
        res = faithfulness(lm, [TEXT, TEXT[::-1]], options=opts, out=tmp_path / how, progress=False)
        assert json.loads((tmp_path / how / "config.json").read_text())["intervention"] == how
        nll[how] = res.per_sequence.query("rate == 0.5").nll.to_numpy()
    assert not np.allclose(nll["key_mask"], nll["value_zero"])
    assert not np.allclose(nll["mean_value"], nll["value_zero"])
    config_file = tmp_path / "value_zero" / "config.json"
    config = json.loads(config_file.read_text())
    del config["intervention"]  # as written before the option existed
    config_file.write_text(json.dumps(config))
    faithfulness(lm, [TEXT, TEXT[::-1]], out=tmp_path / "value_zero", resume=True, **kw)
    with pytest.raises(ValueError, match="unknown intervention"):
        FaithfulnessOptions(intervention="drop")


def test_baselines_rank_like_measures():
    """random:SEED and recency run beside the measures (the default): recency removes the
    latest eligible tokens, the seeds draw different rankings, and a run can have none."""
    import numpy as np

    from contribution_weights.interventions import sequence_salt

    lm = tiny_model("llama")
    res = faithfulness(lm, [TEXT, TEXT[::-1]], measures=["attention"], rates=[0.5],
                       modes=["comprehensiveness"], progress=False)  # fmt: skip
    assert list(dict.fromkeys(res.per_sequence.measure)) == [
        "attention", "random:0", "random:1", "random:2", "recency"
    ]  # fmt: skip
    assert res.config["baselines"] == ["random", "recency"] and res.config["random_seeds"] == 3
    ids = _ids()
    rows = [Removal(m, "comprehensiveness", 0.5) for m in ("recency", "random:0", "random:1")]
    history, _ = _run_history(lm, rows, ids)
    rec = history[0]
    t = ids.numel()
    eligible = rec.eligible[0].nonzero().flatten()
    latest = eligible[-int(np.ceil(0.5 * len(eligible))) :]
    assert rec.removed[0, :, latest].all() and rec.removed[0].sum() == 4 * len(latest)
    assert not torch.equal(rec.removed[1], rec.removed[2])  # two seeds, two rankings
    assert rec.removed[1].shape[-1] == t
    # another text of the same length draws another random ranking (salted by its ids)
    other, _ = _run_history(lm, rows, ids.flip(0), salt=sequence_salt(ids.flip(0)))
    again, _ = _run_history(lm, rows, ids, salt=sequence_salt(ids))
    assert not torch.equal(other[0].removed[1], again[0].removed[1])
    repeat, _ = _run_history(lm, rows, ids, salt=sequence_salt(ids))
    assert torch.equal(again[0].removed[1], repeat[0].removed[1])  # reproducible
    with pytest.raises(ValueError, match="unknown baseline 'oracle'"):
        faithfulness(lm, [TEXT], baselines="oracle", progress=False)
    with pytest.raises(ValueError, match="random:SEED"):
        SequentialRemoval([Removal("random:x", "comprehensiveness", 0.5)])


def test_end_to_end_rankings_run_as_baselines():
    """flow, rollout and alti rank every layer and head by the clean text's end-to-end token
    scores (token_flow_scores): the removed tokens are the top eligible ones by those scores,
    the same in every layer; a sweep runs them beside the measures, in both scopes; without
    its scores a removal asks for them."""
    import numpy as np

    from contribution_weights.attribution.flow import end_to_end_scores, token_flow_scores

    lm = tiny_model("llama")
    ids = _ids()
    fixed = end_to_end_scores(lm, ids, ["recency", "flow", None, "rollout"])
    assert set(fixed) == {"flow", "rollout"}
    assert torch.equal(fixed["flow"], token_flow_scores(lm, ids, ["flow"])["flow"])
    rows = [Removal(m, "comprehensiveness", 0.5) for m in ("flow", "rollout")]
    history, _ = _run_history(lm, rows, ids, fixed_scores=fixed)
    for rec in history.values():
        for b, name in enumerate(("flow", "rollout")):
            eligible = rec.eligible[b].nonzero().flatten()
            k = int(np.ceil(0.5 * len(eligible)))
            top = eligible[fixed[name][eligible].argsort(descending=True, stable=True)[:k]]
            want = torch.zeros(ids.numel(), dtype=torch.bool)
            want[top] = True
            assert (rec.removed[b] == want).all(), name  # every head alike
    with pytest.raises(ValueError, match="end-to-end scores"):
        _run_history(lm, rows, ids)
    for scope in ("layer", "global"):
        res = faithfulness(lm, [TEXT, TEXT[::-1]], measures=["ihc"], rates=[0.2],
                           baselines="flow,alti", scope=scope, progress=False)  # fmt: skip
        assert list(dict.fromkeys(res.per_sequence.measure)) == ["ihc", "flow", "alti"]
        assert res.per_sequence["delta_nll"].notna().all()
