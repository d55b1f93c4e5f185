"""Downstream scoring under sufficiency removal over the prompt (paper Figure 4)."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import tiny_model

from contribution_weights.capture import capturing
from contribution_weights.data import ChoiceItem
from contribution_weights.experiments.downstream import (
    SUMMARY_COLUMNS,
    downstream,
    encode_item,
    option_scores,
    pick,
)
from contribution_weights.interventions import CLEAN, Removal, SequentialRemoval, tracking_sinks

ITEMS = [
    ChoiceItem("the cat sat on the", [" mat", " dog ran", " x"], 0),
    ChoiceItem("one two three", [" four", " five six"], 1),
    ChoiceItem("abc abc ab", ["c", " zz"], 0),
]


def _brute_option_logprob(lm, prompt, option):
    ids = torch.tensor([[*prompt, *option]])
    with torch.no_grad():
        logp = torch.log_softmax(lm.model(input_ids=ids).logits[0].double(), dim=-1)
    p = len(prompt)
    return sum(float(logp[p - 1 + k, tok]) for k, tok in enumerate(option))


def test_clean_option_scores_are_summed_option_logprobs():
    lm = tiny_model("llama")
    for item in ITEMS:
        prompt, options = encode_item(lm, item)
        got = option_scores(lm, prompt, options, [CLEAN])[0]
        want = torch.tensor([_brute_option_logprob(lm, prompt, o) for o in options])
        torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-5, atol=1e-5)
        assert int(pick(got[None])[0]) == int(want.argmax())


def test_one_token_options_read_from_one_row_equal_a_row_per_option():
    """MMLU/BoolQ options are one token each: one row per configuration on the prompt
    alone scores them all, as the row-per-option layout does, under removals too."""
    from contribution_weights.interventions import token_logprobs

    lm = tiny_model("qwen2")
    prompt = list(range(3, 17))
    options = [[20], [21], [22], [23]]
    removals = [
        CLEAN,
        Removal("vw_on", "sufficiency", 0.5),
        Removal("attention", "sufficiency", 0.3),
    ]
    got = option_scores(lm, prompt, options, removals)
    rows = [(r, o) for r in removals for o in options]
    ids = torch.tensor([[*prompt, *o] for _, o in rows])
    logp = token_logprobs(lm, ids, [r for r, _ in rows], eligible_len=len(prompt))
    want = logp[:, len(prompt) - 1].double().reshape(len(removals), len(options))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got[0], got[1])  # the removal changed the scores
    one_by_one = option_scores(lm, prompt, options, removals, batch_size=1)
    torch.testing.assert_close(one_by_one, got, rtol=1e-5, atol=1e-5)


def test_pick_hand_made_scores():
    scores = torch.tensor([[-3.0, -1.0, -2.0], [-0.5, -0.7, -9.0], [-1.0, -1.0, -4.0]])
    assert pick(scores).tolist() == [1, 0, 0]  # ties go to the first option


def test_removal_only_touches_prompt_tokens_and_is_the_same_for_every_option():
    lm = tiny_model("gemma2")
    prompt, options = encode_item(lm, ITEMS[0])
    p = len(prompt)
    width = p + max(len(o) for o in options)
    ids = torch.full((len(options), width), prompt[0])
    for r, o in enumerate(options):
        ids[r, : p + len(o)] = torch.tensor([*prompt, *o])
    rm = [Removal("ihc", "sufficiency", 0.5)] * len(options)
    inter = SequentialRemoval(rm, eligible_len=p, keep_history=True)
    with torch.no_grad(), tracking_sinks(lm.model) as sinks:
        inter.sinks = sinks
        with capturing(lm.model, intervention=inter):
            lm.model(input_ids=ids)
    for rec in inter.history.values():
        assert not rec.eligible[:, p:].any() and not rec.removed[:, :, p:].any()
        assert rec.removed.any()
        for r in range(1, len(options)):  # queries after the prompt do not change the choice
            assert torch.equal(rec.removed[r], rec.removed[0])
            torch.testing.assert_close(rec.scores[r, :, :p], rec.scores[0, :, :p])


def test_downstream_run_writes_summary_and_rate_zero_keeps_clean_accuracy(tmp_path):
    lm = tiny_model("qwen3")
    res = downstream(lm, ITEMS, task="toy", measures=["attention", "ihc"], rates=[0.0, 0.5],
                     out=tmp_path / "d", progress=False)  # fmt: skip
    s = res.summary
    assert list(s.columns) == SUMMARY_COLUMNS and (s.n == len(ITEMS)).all()
    per = res.per_item
    clean = per.drop_duplicates("item")
    assert s.clean_accuracy.iloc[0] == pytest.approx(clean.clean_correct.mean())
    zero = s[s.rate == 0.0]
    assert (zero.accuracy == zero.clean_accuracy).all()
    assert (per[per.rate == 0.0].pick == per[per.rate == 0.0].clean_pick).all()
    assert (tmp_path / "d" / "summary.csv").exists()
    assert not (tmp_path / "d" / "downstream.png").exists()  # the CLI writes figures


def test_cli_downstream_writes_the_figure(tmp_path, monkeypatch, fixture_data):
    from contribution_weights.cli import main

    lm = tiny_model("llama")
    monkeypatch.setattr("contribution_weights.loading.load_model", lambda *a, **k: lm)
    rc = main(["downstream", "--task", "winogrande", "--n", "2", "--data-dir", str(fixture_data),
               "--measures", "attention", "--rates", "0.5", "--max-tokens", "120",
               "--out", str(tmp_path / "o")])  # fmt: skip
    assert rc == 0
    assert (tmp_path / "o" / "downstream.png").stat().st_size > 0


def test_items_longer_than_max_tokens_are_skipped():
    lm = tiny_model("llama")
    res = downstream(lm, ITEMS, measures=["attention"], rates=[0.5], max_tokens=15,
                     progress=False)  # fmt: skip
    assert len(res.skipped) == 2 and res.summary.n.iloc[0] == 1
    assert all("> max_tokens" in s["reason"] for s in res.skipped)


@pytest.mark.slow
def test_smollm2_picks_the_obvious_option(smollm2):
    items = [
        ChoiceItem("The capital of France is", [" banana", " Paris"], 1),
        ChoiceItem("Monday, Tuesday, Wednesday,", [" Thursday", " purple"], 0),
        ChoiceItem("1, 2, 3, 4, 5,", [" 19", " 6"], 1),
    ]
    for item in items:
        prompt, options = encode_item(smollm2, item)
        scores = option_scores(smollm2, prompt, options, [CLEAN])
        assert int(pick(scores)[0]) == item.answer, (item, scores)


def test_resume_redoes_an_item_cut_mid_write(tmp_path):
    lm = tiny_model("qwen3")
    kw = dict(task="toy", measures=["attention", "ihc"], rates=[0.0, 0.5], progress=False)
    first = downstream(lm, ITEMS, out=tmp_path / "d", **kw)
    csv = tmp_path / "d" / "per_item.csv"
    lines = csv.read_text().splitlines(keepends=True)
    csv.write_text("".join(lines[:3]))  # header and 2 of item 0's 4 rows
    resumed = downstream(lm, ITEMS, out=tmp_path / "d", resume=True, **kw)
    assert (resumed.summary.n == len(ITEMS)).all()
    assert sorted(resumed.per_item.item.tolist()) == sorted(first.per_item.item.tolist())
    assert resumed.summary.accuracy.tolist() == first.summary.accuracy.tolist()


def test_a_measure_string_is_a_name_not_letters():
    lm = tiny_model("llama")
    res = downstream(lm, ITEMS[:1], measures="ihc", rates=0.5, baselines="none", progress=False)
    assert res.config["measures"] == ["ihc"] and res.summary.measure.tolist() == ["ihc"]


def test_max_tokens_below_two_is_refused():
    lm = tiny_model("llama")
    with pytest.raises(ValueError, match="at least 2"):
        downstream(lm, ITEMS, max_tokens=1, progress=False)


def test_resume_with_changed_items_is_refused(tmp_path):
    from contribution_weights.runs import RunFolderError

    lm = tiny_model("llama")
    kw = dict(task="toy", measures=["attention"], rates=[0.5], progress=False)
    downstream(lm, ITEMS, out=tmp_path / "d", **kw)
    changed = [ITEMS[0], ChoiceItem(ITEMS[1].prompt, ITEMS[1].options, 0), ITEMS[2]]
    with pytest.raises(RunFolderError, match="items_sha256"):
        downstream(lm, changed, out=tmp_path / "d", resume=True, **kw)
    again = downstream(lm, ITEMS, out=tmp_path / "d", resume=True, **kw)
    assert (again.summary.n == len(ITEMS)).all()


def test_fingerprint_is_the_old_text_digest_and_sees_every_part():
    import hashlib

    from contribution_weights.runs import fingerprint

    texts = ["a", "bc"]
    for algorithm in ("sha1", "sha256"):
        old = hashlib.new(algorithm)
        for t in texts:
            old.update(t.encode() + b"\0")
        assert fingerprint(texts, algorithm=algorithm) == old.hexdigest()[:16]
    base = fingerprint([["p", ["x", "y"], 0]])
    assert base != fingerprint([["p", ["x", "y"], 1]]) != fingerprint([["p", ["y", "x"], 0]])


def test_wilson_interval_and_exact_binomial_test_known_values():
    from contribution_weights.experiments.downstream import binomial_test, wilson_interval

    lo, hi = wilson_interval(5, 10)
    assert lo == pytest.approx(0.236593, abs=1e-6) and hi == pytest.approx(0.763407, abs=1e-6)
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.277532), abs=1e-6)
    assert binomial_test(3, 10, 0.5) == pytest.approx(0.34375)
    assert binomial_test(0, 10, 0.5) == pytest.approx(2 / 1024)
    assert binomial_test(5, 10, 0.5) == pytest.approx(1.0)
    assert binomial_test(0, 0, 0.5) == 1.0
    # asymmetric null: P(X <= 1) + the upper outcomes no more likely, X ~ Bin(8, 0.25)
    pmf = [math.comb(8, i) * 0.25**i * 0.75 ** (8 - i) for i in range(9)]
    assert binomial_test(5, 8, 0.25) == pytest.approx(sum(v for v in pmf if v <= pmf[5]))


def test_summary_intervals_mcnemar_and_chance_from_per_item_rows():
    from contribution_weights.experiments.downstream import per_item_frame, summarise

    rows = []
    for item in range(20):
        clean_ok = int(item < 12)
        ok = int(item < 4 or item >= 18)  # 8 lost (4..11), 2 gained (18, 19)
        rows.append({"item": item, "measure": "vw", "rate": 0.5, "answer": 0, "pick": 1 - ok,
                     "correct": ok, "clean_pick": 1 - clean_ok, "clean_correct": clean_ok,
                     "n_prompt_tokens": 5, "n_options": 4 if item % 2 else 2})  # fmt: skip
    # a second configuration whose answers are the clean ones: p = 1, a Holm family of two
    same = [{**r, "measure": "ihc", "pick": r["clean_pick"], "correct": r["clean_correct"]}
            for r in rows]  # fmt: skip
    table = summarise(per_item_frame(rows + same), "toy")
    s = table.iloc[0]
    assert s.accuracy == pytest.approx(6 / 20) and s.clean_accuracy == pytest.approx(12 / 20)
    assert s.chance == pytest.approx((0.5 + 0.25) / 2)
    assert s.p_vs_clean == pytest.approx(binomial_test_ref(2, 10))
    assert s.p_vs_clean_holm == pytest.approx(min(1.0, 2 * binomial_test_ref(2, 10)))
    assert table.iloc[1].p_vs_clean == 1.0 and table.iloc[1].p_vs_clean_holm == 1.0
    assert s.accuracy_lo < s.accuracy < s.accuracy_hi and s.clean_lo < s.clean_accuracy < s.clean_hi
    assert s.changed == pytest.approx(10 / 20)  # 8 lost + 2 gained answers differ from clean


def binomial_test_ref(k, n):
    """Two-sided exact test against 1/2, by hand: twice the smaller tail."""
    tail = sum(math.comb(n, i) for i in range(min(k, n - k) + 1)) / 2**n
    return min(1.0, 2 * tail)


def test_intervals_hold_the_estimate_at_zero_and_full_accuracy_and_plot():
    from contribution_weights.experiments.downstream import wilson_interval
    from contribution_weights.presentation.faithfulness_plots import plot_downstream

    for n in range(1, 300):  # rounding once put a bound a hair past 0 or 1
        lo, hi = wilson_interval(n, n)
        assert lo <= 1.0 == hi
        lo, hi = wilson_interval(0, n)
        assert lo == 0.0 <= hi
    rows = []
    for item in range(10):
        rows.append({"item": item, "measure": "vw", "rate": 0.5, "answer": 0, "pick": 0,
                     "correct": 1, "clean_pick": 0, "clean_correct": 1,
                     "n_prompt_tokens": 5, "n_options": 2})  # fmt: skip
        rows.append({**rows[-1], "measure": "ihc", "pick": 1, "correct": 0})
    from contribution_weights.experiments.downstream import per_item_frame, summarise

    summary = summarise(per_item_frame(rows), "toy")
    assert summary.accuracy.tolist() == [1.0, 0.0]
    plot_downstream(summary)  # error bars are never negative


def test_cli_downstream_reads_the_users_own_items(tmp_path, monkeypatch, capsys):
    import json

    from contribution_weights.cli import main
    from contribution_weights.data import read_items
    from contribution_weights.experiments.downstream import DownstreamResult
    from contribution_weights.runs import fingerprint

    lm = tiny_model("llama")
    monkeypatch.setattr("contribution_weights.loading.load_model", lambda *a, **k: lm)
    rows = [
        {"sentence": "The cup fell because _ was full.", "option1": "it", "option2": "he",
         "answer": "1"},
        {"prompt": "Two and two make", "options": [" three", " four"], "answer": 1},
        {"sentence": "Ann thanked Bo because _ had helped.", "option1": "Ann", "option2": "Bo",
         "answer": "2"},
    ]  # fmt: skip
    f = tmp_path / "mine.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "o"
    rc = main(["downstream", "--task", "winogrande", "--items", str(f), "--n", "2",
               "--measures", "attention", "--rates", "0.5", "--out", str(out)])  # fmt: skip
    assert rc == 0
    res = DownstreamResult.load(out)
    assert sorted(res.per_item["item"].unique()) == [0, 1] and (res.summary.n == 2).all()
    assert res.config["items_sha256"] == fingerprint(
        [it.prompt, it.options, it.answer] for it in read_items(f, "winogrande", 2)
    )
    rows[1] = {"prompt": "Two and two make", "answer": 1}
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    assert main(["downstream", "--task", "winogrande", "--items", str(f),
                 "--out", str(tmp_path / "o2")]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert f"{f}:2: the item has no field 'options'" in err and "option1, option2" in err
    with pytest.raises(SystemExit):  # one source of items, not two
        main(["downstream", "--task", "boolq", "--items", str(f), "--data-dir", str(tmp_path),
              "--out", str(tmp_path / "o3")])  # fmt: skip


def test_end_to_end_rankings_score_the_prompt_alone():
    """The flow baseline of a downstream item reads the prompt only (its queries and keys):
    the options that follow never change which prompt tokens it removes, and it runs in a
    downstream sweep beside the measures."""
    from contribution_weights.attribution.flow import end_to_end_scores
    from contribution_weights.interventions import token_logprobs

    lm = tiny_model("llama")
    prompt, options = encode_item(lm, ITEMS[0])
    p = len(prompt)
    on_prompt = end_to_end_scores(lm, torch.tensor(prompt), ["flow"])["flow"]
    width = p + max(len(o) for o in options)
    ids = torch.full((len(options), width), prompt[0])
    for r, o in enumerate(options):
        ids[r, : p + len(o)] = torch.tensor([*prompt, *o])
    limited = end_to_end_scores(lm, ids[1], ["flow"], eligible_len=p)["flow"]
    torch.testing.assert_close(limited[:p], on_prompt, rtol=1e-6, atol=1e-7)
    assert not limited[p:].any()
    removals = [Removal("flow", "sufficiency", 0.5)] * len(options)
    with pytest.raises(ValueError, match="end-to-end scores"):
        token_logprobs(lm, ids, removals, eligible_len=p)
    removed = token_logprobs(lm, ids, removals, eligible_len=p, fixed_scores={"flow": limited})
    clean = token_logprobs(lm, ids, [CLEAN] * len(options), eligible_len=p)
    assert not torch.equal(removed, clean)
    res = downstream(lm, ITEMS, task="toy", measures=["ihc"], rates=[0.5], baselines="flow",
                     progress=False)  # fmt: skip
    assert set(res.per_item["measure"]) == {"ihc", "flow"}
