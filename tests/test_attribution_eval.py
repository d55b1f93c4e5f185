"""attribution-eval: the known-answer items, the two ways a token is removed, the run and
its statistics."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch
from tiny_models import tiny_model

import contribution_weights as cw
from contribution_weights.attribution.tasks import (
    PHRASINGS,
    SEPARATORS,
    make_item,
    recipe,
    text_item,
)
from contribution_weights.capture import AttentionEdit, capturing
from contribution_weights.experiments.attribution_eval import (
    AttributionEvalOptions,
    AttributionEvalResult,
    Editor,
    attribution_eval,
    removal_sets,
)


@pytest.mark.parametrize("task", ["induction", "lookup", "passkey"])
def test_known_answer_items_put_the_answer_at_the_source(smollm2, task):
    tok = smollm2.tokenizer
    for index in range(4):
        item = make_item(task, tok, index, seed=3, tokens=64)
        assert item == make_item(task, tok, index, seed=3, tokens=64)  # seeded
        assert len(item.ids) <= 64
        (source,) = item.sources
        assert source < item.position
        assert item.ids[source] == item.answer
        # the answer is not simply the token before the target, nor at the target
        assert item.ids[item.position] != item.answer or task == "induction"
    assert make_item(task, tok, 0, 3, 64).ids != make_item(task, tok, 1, 3, 64).ids


@pytest.mark.parametrize("task", ["induction", "lookup", "passkey"])
def test_fresh_items_draw_their_construction_from_the_seed(smollm2, task):
    """The fresh generator: answer at the source, lengths drawn in [tokens/2, tokens], ids
    from the seed's vocabulary range, and none of the words generator's phrasing."""
    tok = smollm2.tokenizer
    special = set(tok.all_special_ids)
    r = recipe(tok, 5)
    lengths = set()
    for index in range(12):
        item = make_item(task, tok, index, 5, 64, "fresh")
        assert item == make_item(task, tok, index, 5, 64, "fresh")  # seeded
        assert item != make_item(task, tok, index, 5, 64)  # not the words family
        (source,) = item.sources
        assert item.ids[source] == item.answer and source < item.position
        assert len(item.ids) <= 64
        lengths.add(len(item.ids))
        body = item.ids[1:]  # after the BOS
        drawn = [t for t in body if r.low <= t < r.high]
        assert not special & set(body)
        if task != "passkey":  # every key, value and copied id comes from the range
            assert item.answer in drawn and len(drawn) >= len(body) // 2
    assert len(lengths) > 2  # lengths are drawn per item
    text = tok.decode(make_item(task, tok, 0, 5, 64, "fresh").ids)
    if task == "passkey":
        assert PHRASINGS[r.phrasing][0].strip() in text and "pass key" not in text
    if task == "lookup":
        assert SEPARATORS[r.separator][0] in text
    assert len({recipe(tok, s) for s in (1, 2, 3)}) == 3  # three settings differ


def test_generator_options_are_checked():
    with pytest.raises(ValueError, match="unknown generator"):
        AttributionEvalOptions(generator="other").validate()
    with pytest.raises(ValueError, match="deletion task reads texts"):
        AttributionEvalOptions(task="deletion", generator="fresh").validate()
    with pytest.raises(ValueError, match="unknown generator"):
        make_item("induction", None, 0, 0, 64, "other")


def test_known_answer_items_are_solved_by_the_model(smollm2):
    """Induction and lookup are what small models do well: most items right at top-1."""
    right = 0
    for index in range(8):
        item = make_item("induction", smollm2.tokenizer, index, seed=0, tokens=48)
        with torch.no_grad():
            logits = smollm2.model(input_ids=torch.tensor([item.ids])).logits[0, -1]
        right += int(logits.argmax()) == item.answer
    assert right >= 6


def test_removal_sets_cover_the_modes():
    order = torch.arange(10, 0, -1)
    sets = {(m, r): s for m, r, s in removal_sets(order, [0.1, 0.5])}
    assert sets["comprehensiveness", 0.1].tolist() == [10]
    assert sets["sufficiency", 0.1].tolist() == [1]
    assert sets["insertion", 0.1].tolist() == list(range(9, 0, -1))  # all but the top one
    assert len(sets["comprehensiveness", 0.5]) == 5


class _MaskKeys:
    def __init__(self, gone: list[int]) -> None:
        self.gone = gone

    def edit(self, call):
        masked = torch.zeros(call.batch, call.num_heads, call.k_len, dtype=torch.bool)
        masked[:, :, self.gone] = True
        return AttentionEdit(masked=masked)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_key_mask_by_attention_mask_equals_masking_every_softmax(family):
    """The attention-mask removal is the key_mask intervention of every layer and head."""
    model = tiny_model(family, dtype=torch.float64)
    ids = torch.randint(3, 90, (14,))
    gone = [2, 5, 6]
    editor = Editor(model, batch_size=4)
    value = editor.values(ids, 7, [torch.tensor(gone)], "key_mask")[0]
    with capturing(model.model, [], intervention=_MaskKeys(gone)), torch.no_grad():
        logits = model.model(input_ids=ids[None], use_cache=False).logits[0, -1]
    expected = float(torch.log_softmax(logits, -1)[7])
    assert value == pytest.approx(expected, abs=1e-6)
    assert value != pytest.approx(editor.values(ids, 7, [torch.tensor([])], "key_mask")[0])


def test_a_set_removed_twice_runs_once(monkeypatch):
    """Rankings that agree on a rate's set share one forward; every row still gets it."""
    model = tiny_model("llama", dtype=torch.float64)
    ids = torch.randint(3, 90, (12,))
    editor = Editor(model, batch_size=2)
    sets = [torch.tensor([3, 1]), torch.tensor([4]), torch.tensor([1, 3]), torch.tensor([])]
    alone = [editor.values(ids, 5, [s], "key_mask")[0] for s in sets]
    rows = []
    forward = model.model.forward
    monkeypatch.setattr(
        model.model,
        "forward",
        lambda *a, **k: rows.append(k["input_ids"].shape[0]) or forward(*a, **k),
    )
    together = editor.values(ids, 5, sets, "key_mask")
    assert sum(rows) == 3  # {1, 3} once, {4}, nothing
    assert together == pytest.approx(alone, abs=1e-9)
    assert together[0] == together[2] and together[1] != together[3]


def test_embedding_removal_uses_the_mean_embedding():
    model = tiny_model("llama", dtype=torch.float64)
    ids = torch.randint(3, 90, (10,))
    editor = Editor(model, batch_size=2)
    embeds = model.model.get_input_embeddings()(ids[None]).clone()
    embeds[0, [1, 4]] = model.model.get_input_embeddings().weight.mean(0)
    with torch.no_grad():
        logits = model.model(inputs_embeds=embeds).logits[0, -1]
    expected = float(torch.log_softmax(logits, -1)[5])
    got = editor.values(ids, 5, [torch.tensor([1, 4])], "embedding")[0]
    assert got == pytest.approx(expected, abs=1e-5)  # the editor reads float32 logits


def test_a_deletion_run_writes_its_tables_and_resumes(tmp_path):
    model = tiny_model("llama")
    texts = ["abcdefghijklmnopqrstuvwxyz" * 2, "the quick brown fox jumps over the lazy dog"]
    options = AttributionEvalOptions(
        task="deletion", n=2, tokens=20, methods="flow,input_x_gradient", rates=[0.1, 0.5]
    )
    assert text_item(model.tokenizer, texts[0], 20) is not None
    result = attribution_eval(model, texts, options=options, out=tmp_path)
    rows = result.rows
    assert set(rows["kind"]) == {"hit", "curve"}
    assert rows[rows["kind"] == "hit"]["rank"].isna().all()  # no known source
    curves = rows[rows["kind"] == "curve"]
    assert set(curves["mode"]) == {"comprehensiveness", "sufficiency", "insertion"}
    assert set(curves["intervention"]) == {"key_mask", "embedding"}
    # 2 methods + 3 seeds + recency, 2 interventions, 3 modes, 2 rates, per item
    assert len(curves) == 2 * 6 * 2 * 3 * 2
    assert {
        "measure",
        "comprehensiveness_key_mask",
        "sufficiency_embedding",
        "insertion_key_mask",
    } <= set(result.summary.columns)
    for name in ("summary.csv", "curves.csv", "paired.csv", "rows.csv", "tables.md"):
        assert (tmp_path / name).is_file()
    assert not (tmp_path / "hits_paired.csv").exists()  # no known answers, no hit tests
    tables = (tmp_path / "tables.md").read_text()  # no hit rates, the seconds instead
    assert "## Seconds per item" in tables and "top-1" not in tables and "nan" not in tables
    assert result.summary["top1_all"].isna().all()  # not a 0% hit rate
    again = attribution_eval(model, texts, options=options, out=tmp_path, resume=True)
    pd.testing.assert_frame_equal(again.rows, result.rows, check_dtype=False)
    config_file = tmp_path / "config.json"
    config = json.loads(config_file.read_text())
    del config["generator"]  # as a run written before --generator existed
    config_file.write_text(json.dumps(config))
    again = attribution_eval(model, texts, options=options, out=tmp_path, resume=True)
    pd.testing.assert_frame_equal(again.rows, result.rows, check_dtype=False)
    cw.plot(again, tmp_path / "attribution-eval.png")
    assert (tmp_path / "attribution-eval.png").stat().st_size > 10_000


def _hits(flow: list[int], other: list[int]) -> AttributionEvalResult:
    rows = []
    for i, (a, b) in enumerate(zip(flow, other, strict=True)):
        for name, hit in (("flow", a), ("input_x_gradient", b)):
            rows.append({"item": i, "kind": "hit", "measure": name, "hit1": hit, "hit5": 1,
                         "rank": 1 if hit else 3, "seconds": 0.1, "tokens": 9, "rate": "",
                         "value_full": 0.0, "value": "", "delta": "", "correct": 1,
                         "rank_all": 1 if hit else 3})  # fmt: skip
    return AttributionEvalResult(AttributionEvalResult.frame(rows), {})


def test_top1_hits_are_compared_paired_and_corrected():
    """A known answer: flow right on 30 items where the other is wrong, never the reverse,
    is a win; an even split is a tie."""
    win = _hits([1] * 30 + [0] * 10, [0] * 30 + [0] * 10).hits_paired()
    assert win.loc[0, "verdict"] == "reference better" and win.loc[0, "b"] == 30
    tie = _hits([1, 0] * 20, [0, 1] * 20).hits_paired()
    assert tie.loc[0, "verdict"] == "tie"
    assert math.isclose(tie.loc[0, "p"], 1.0)


def test_hits_rank_the_source_among_the_candidates_and_among_all():
    from contribution_weights.attribution.tasks import Item
    from contribution_weights.experiments.attribution_eval import AttributionEval

    item = Item(ids=[5, 6, 7, 8, 9, 10], answer=7, sources=[2])
    scores = torch.tensor([0.9, 0.1, 0.5, 0.3, 0.2, 5.0])  # the target (5) never counts
    protected = AttributionEval._hits(scores, item, protect_first=True)
    assert protected == {"rank": 1.0, "hit1": 1.0, "hit5": 1.0, "rank_all": 2.0}
    assert AttributionEval._hits(scores, item, protect_first=False)["rank"] == 2.0


def test_known_answer_runs_score_the_baselines_hits_and_add_them_on_resume(smollm2, tmp_path):
    """The baselines' hits come from the orders the curves remove by: recency ranks the
    source (position − source)th; the three random seeds pool into one ``random`` row. A
    folder without them (a run made before they existed) gets them on ``--resume``, its
    rows untouched."""
    options = AttributionEvalOptions(task="induction", n=2, tokens=32, methods="flow,rollout",
                                     rates=[0.5], interventions="key_mask")  # fmt: skip
    result = attribution_eval(smollm2, options=options, out=tmp_path)
    extra = result.baseline_hits
    assert sorted(set(extra["measure"])) == ["random:0", "random:1", "random:2", "recency"]
    assert len(extra) == 2 * 4 and extra["rank_all"].isna().all()
    for index in range(2):
        item = make_item("induction", smollm2.tokenizer, index, seed=0, tokens=32)
        row = extra[(extra["item"] == index) & (extra["measure"] == "recency")].iloc[0]
        assert row["rank"] == item.position - item.sources[0]
        ranks = extra[extra["item"] == index]["rank"]
        assert ranks.between(1, item.position - 1).all()
    summary = result.summary.set_index("measure")
    assert {"flow", "random", "recency"} <= set(summary.index)
    assert summary.loc["random", "n"] == 2 and not math.isnan(summary.loc["recency", "top1"])
    assert list(result.hits_paired()["other"]) == ["rollout"]  # methods only
    rows_before = (tmp_path / "rows.csv").read_text()
    saved = (tmp_path / "baseline_hits.csv").read_text()
    (tmp_path / "baseline_hits.csv").unlink()
    again = attribution_eval(smollm2, options=options, out=tmp_path, resume=True)
    assert (tmp_path / "baseline_hits.csv").read_text() == saved
    assert (tmp_path / "rows.csv").read_text() == rows_before
    pd.testing.assert_frame_equal(again.summary, result.summary)
    loaded = AttributionEvalResult.load(tmp_path)
    pd.testing.assert_frame_equal(loaded.baseline_hits, result.baseline_hits, check_dtype=False)
    cw.plot(loaded, tmp_path / "attribution-eval.png")  # a hit-rate bar per pooled ranking
    assert (tmp_path / "attribution-eval.png").stat().st_size > 10_000


def test_baseline_hits_cover_the_items_the_methods_have_and_saves_leave_no_stale_file(tmp_path):
    """A baseline row of an item the first phase skipped is not counted, and saving a result
    without baseline hits removes an earlier result's file instead of reading it back."""
    methods = _hits([1, 0], [0, 0])
    extra = AttributionEvalResult.frame(
        [{"item": i, "kind": "hit", "measure": "recency", "rank": 2.0, "hit1": 0.0, "hit5": 1.0,
          "rank_all": "", "tokens": 9, "rate": "", "value_full": "", "value": "", "delta": "",
          "correct": "", "seconds": ""} for i in (0, 1, 2)]  # item 2: skipped by the methods
    )  # fmt: skip
    result = AttributionEvalResult(methods.rows, {}, None, extra)
    assert sorted(result.hits[result.hits["measure"] == "recency"]["item"]) == [0, 1]
    assert result.summary.set_index("measure").loc["recency", "n"] == 2
    result.save(tmp_path)
    assert (tmp_path / "baseline_hits.csv").is_file()
    AttributionEvalResult(methods.rows, {}).save(tmp_path)
    assert not (tmp_path / "baseline_hits.csv").exists()
    assert AttributionEvalResult.load(tmp_path).baseline_hits.empty


def test_a_method_added_to_a_finished_run_equals_one_run_from_the_start(tmp_path):
    """``--add-methods`` on ``--resume`` scores only the new method, in a phase of its own
    (``added-{method}.csv``), leaves the run's rows as they were, and gives the rows a run
    with the method from the start gives; the run stays extended on a later resume, and a
    second method comes after the first."""
    model = tiny_model("llama")
    texts = ["abcdefghijklmnopqrstuvwxyz" * 2, "the quick brown fox jumps over the lazy dog"]
    common = {"task": "deletion", "n": 2, "tokens": 20, "rates": [0.2, 0.5]}
    first = AttributionEvalOptions(methods="flow", **common)
    run = tmp_path / "run"
    before_adding = attribution_eval(model, texts, options=first, out=run).paired()
    own = (run / "rows.csv").read_text()
    added = AttributionEvalOptions(methods="flow", added_methods="direct", **common)
    result = attribution_eval(model, texts, options=added, out=run, resume=True)
    assert (run / "rows.csv").read_text() == own
    assert json.loads((run / "config.json").read_text())["added_methods"] == ["direct"]
    assert set(result.added["measure"]) == {"direct"} and set(result.rows["measure"]) >= {"flow"}
    assert "direct" not in set(result.rows["measure"])
    both = AttributionEvalOptions(methods="flow,direct", **common)
    whole = attribution_eval(model, texts, options=both, out=tmp_path / "whole")
    key = ["item", "kind", "measure", "intervention", "mode", "rate"]
    mine = result.all_rows[result.all_rows["measure"] == "direct"].sort_values(key)
    theirs = whole.rows[whole.rows["measure"] == "direct"].sort_values(key)
    for column in ("delta", "value", "value_full"):
        assert mine[column].tolist() == pytest.approx(theirs[column].tolist(), nan_ok=True)
    summary = result.summary.set_index("measure")
    assert {"flow", "direct", "random", "recency"} <= set(summary.index)
    paired = result.paired()
    assert set(paired["reference"]) == {"flow", "direct"}
    # the added method is a Holm family of its own: the run's verdicts stay as they were
    pd.testing.assert_frame_equal(
        paired[paired["reference"] == "flow"].reset_index(drop=True), before_adding
    )
    direct = paired[paired["reference"] == "direct"]
    assert set(direct["other"]) == {"flow", "random", "recency"}
    assert set(whole.paired()[lambda t: t["reference"] == "direct"]["other"]) == {
        "random",
        "recency",
    }  # direct among the run's own methods: flow - direct under flow
    # a later resume without --add-methods keeps the method and recomputes nothing
    before = (run / "added-direct.csv").read_text()
    again = attribution_eval(model, texts, options=first, out=run, resume=True)
    assert (run / "added-direct.csv").read_text() == before
    pd.testing.assert_frame_equal(again.summary, result.summary)
    more = AttributionEvalOptions(methods="flow", added_methods="input_x_gradient", **common)
    attribution_eval(model, texts, options=more, out=run, resume=True)
    config = json.loads((run / "config.json").read_text())
    assert config["added_methods"] == ["direct", "input_x_gradient"]
    loaded = AttributionEvalResult.load(run)
    assert set(loaded.added["measure"]) == {"direct", "input_x_gradient"}
    assert (run / "added-input_x_gradient.csv").is_file()


def test_a_magnitude_twin_ranks_by_absolute_scores_added_or_from_the_start(tmp_path):
    """``direct_abs`` beside ``direct`` takes its scores (and seconds) without running it
    again; added to a run that has ``direct`` it gives the same rows; its order is the
    order of ``|direct|``."""
    from contribution_weights.experiments.attribution_eval import ranking_order

    model = tiny_model("llama")
    texts = ["abcdefghijklmnopqrstuvwxyz" * 2, "the quick brown fox jumps over the lazy dog"]
    common = {"task": "deletion", "n": 2, "tokens": 20, "rates": [0.2, 0.5]}
    whole = attribution_eval(model, texts, out=tmp_path / "whole",
                             options=AttributionEvalOptions(methods="direct,direct_abs",
                                                            **common))  # fmt: skip
    hits = whole.rows[whole.rows["kind"] == "hit"].set_index(["item", "measure"])["seconds"]
    for item in (0, 1):
        assert hits[(item, "direct_abs")] == hits[(item, "direct")]
    # listed twin first, it still waits for its method's scores
    first = attribution_eval(model, texts[:1], out=tmp_path / "first",
                             options=AttributionEvalOptions(methods="direct_abs,direct",
                                                            **{**common, "n": 1}))  # fmt: skip
    hits = first.rows[first.rows["kind"] == "hit"].set_index(["item", "measure"])["seconds"]
    assert hits[(0, "direct_abs")] == hits[(0, "direct")]
    run = tmp_path / "run"
    attribution_eval(model, texts, options=AttributionEvalOptions(methods="direct", **common),
                     out=run)  # fmt: skip
    added = AttributionEvalOptions(methods="direct", added_methods="direct_abs", **common)
    result = attribution_eval(model, texts, options=added, out=run, resume=True)
    key = ["item", "kind", "measure", "intervention", "mode", "rate"]
    mine = result.added.sort_values(key)
    theirs = whole.rows[whole.rows["measure"] == "direct_abs"].sort_values(key)
    assert len(mine) == len(theirs) > 0
    for column in ("delta", "value"):
        assert mine[column].tolist() == pytest.approx(theirs[column].tolist(), nan_ok=True)
    scores = {"direct": torch.tensor([0.0, -3.0, 1.0, 2.0])}
    scores["direct_abs"] = scores["direct"].abs()
    candidates = torch.arange(1, 4)
    assert ranking_order("direct", scores, candidates, 0, 0).tolist() == [3, 2, 1]
    assert ranking_order("direct_abs", scores, candidates, 0, 0).tolist() == [1, 3, 2]


def test_adding_a_method_the_run_has_or_with_other_options_is_refused(tmp_path):
    from contribution_weights.runs import RunFolderError

    with pytest.raises(ValueError, match="already among --methods"):
        AttributionEvalOptions(methods="flow,direct", added_methods="direct")
    model = tiny_model("llama")
    texts = ["abcdefghijklmnopqrstuvwxyz" * 2, "the quick brown fox jumps over the lazy dog"]
    common = {"task": "deletion", "n": 2, "tokens": 20, "rates": [0.5]}
    attribution_eval(model, texts, options=AttributionEvalOptions(methods="flow", **common),
                     out=tmp_path)  # fmt: skip
    other = AttributionEvalOptions(methods="flow", added_methods="direct", seed=1, **common)
    with pytest.raises(RunFolderError, match="seed"):
        attribution_eval(model, texts, options=other, out=tmp_path, resume=True)
    assert "direct" not in (tmp_path / "config.json").read_text()


def test_top1_hits_are_compared_with_flow_and_with_direct_each_pair_once():
    rows = []
    hits = {"flow": [1, 0, 0, 0], "direct": [1, 1, 1, 1], "input_x_gradient": [0, 0, 1, 0]}
    for name, column in hits.items():
        for i, hit in enumerate(column):
            rows.append({"item": i, "kind": "hit", "measure": name, "hit1": hit, "hit5": 1,
                         "rank": 1 if hit else 3, "rank_all": 1 if hit else 3, "tokens": 9,
                         "seconds": 0.1})  # fmt: skip
    from contribution_weights.experiments.attribution_eval import COLUMNS

    rows = [{c: row.get(c, "") for c in COLUMNS} for row in rows]
    table = AttributionEvalResult(AttributionEvalResult.frame(rows), {}).hits_paired()
    pairs = list(zip(table["reference"], table["other"], strict=True))
    assert pairs == [("flow", "direct"), ("flow", "input_x_gradient"),
                     ("direct", "input_x_gradient")]  # fmt: skip
    row = table.iloc[2]
    assert (row["b"], row["c"], row["reference_top1"]) == (3, 0, 1.0)


def test_tables_md_holds_the_hits_the_areas_and_the_verdicts(tmp_path):
    """``tables.md`` (written with the summary): hits ± s.e. by top-1, each ranking's area
    over the curves (delta averaged over the rates item by item, mean ± s.e. over items; the
    best of a column in bold, the direction per mode), verdicts counted over the rates."""
    blank = {"rate": "", "value_full": 0.0, "value": "", "delta": "", "correct": 1, "tokens": 9,
             "hit1": "", "hit5": "", "rank": "", "rank_all": "", "seconds": "",
             "intervention": "", "mode": ""}  # fmt: skip
    rows = []
    for item in range(4):
        for name, base, hit in (("flow", 2.0, int(item < 3)), ("input_x_gradient", 1.0, 0)):
            rows.append({**blank, "item": item, "kind": "hit", "measure": name, "hit1": hit,
                         "hit5": 1, "rank": 1 if hit else 3, "rank_all": 1 if hit else 3,
                         "seconds": 0.5})  # fmt: skip
            for mode in ("comprehensiveness", "sufficiency", "insertion"):
                for rate in (0.1, 0.5):
                    delta = base + item + rate + (0.2 * item * rate if name == "flow" else 0)
                    rows.append({**blank, "item": item, "kind": "curve", "measure": name,
                                 "intervention": "key_mask", "mode": mode, "rate": rate,
                                 "delta": delta})  # fmt: skip
    result = AttributionEvalResult(AttributionEvalResult.frame(rows), {"task": "induction"})
    result.write_summary(tmp_path)
    text = (tmp_path / "tables.md").read_text()
    assert text == result.markdown() + "\n"
    assert text.startswith("# attribution-eval: induction, ?, 4 items of ? tokens")
    hits = [line for line in text.splitlines() if line.startswith("| flow | 4 |")]
    assert hits == ["| flow | 4 | 0.75 ± 0.25 | 1.00 ± 0.00 | 1.5 | 0.75 | 0.5 |"]
    # flow's area: items' means over the rates are 2.3 + 1.06 k (k = 0..3): 3.89 ± 0.68
    areas = [line for line in text.splitlines() if line.startswith("| flow | ") and "±" in line]
    assert areas[-1] == "| flow | **3.89 ± 0.68** | 3.89 ± 0.68 | 3.89 ± 0.68 |"
    ixg = [line for line in text.splitlines() if line.startswith("| input_x_gradient | ")]
    assert "| input_x_gradient | 2.80 ± 0.65 | **2.80 ± 0.65** | **2.80 ± 0.65** |" in ixg
    verdicts = [line for line in text.splitlines() if line.count(" / ") == 6]
    assert len(verdicts) == 1 and verdicts[0].startswith("| input_x_gradient |")
    cells = verdicts[0].strip("| ").split(" | ")[1:]
    # flow's delta is above input × gradient's on every item at both rates: better where
    # a higher delta is (comprehensiveness), worse where a lower one is
    assert cells == ["2 / 0 / 0", "0 / 0 / 2", "0 / 0 / 2"]
    assert "| flow | input_x_gradient | 4 | 3 | 0 | 0.75 / 0.00 |" in text
