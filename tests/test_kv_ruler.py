"""The RULER-like long-context tasks of ``cw kv-eval --task ruler`` (contribution_weights.kv.ruler).

Items are checked by reading them back: the prompt is decoded and parsed (needles, the
variable chain, the word lists) and the answers recomputed from what the text says. The
tokenizers here invert exactly (unlike the tiny models' CharTokenizer, whose decode is not
its inverse): a word-level one with a BOS and, optionally, a chat template, and a
character-level one within the tiny models' vocabulary for the end-to-end run.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from tiny_models import tiny_model

from contribution_weights import data
from contribution_weights.defaults import RULER_TASKS
from contribution_weights.kv.ruler import (
    CWE_COMMON,
    FWE_NOISE,
    NIAH_SHAPE,
    RulerError,
    RulerGenerator,
    ruler_item,
    string_match_all,
)
from contribution_weights.presentation.figures import plot

SPLIT = re.compile(r"(?<=[.!?])\s+|\s*\n+\s*")


class WordTokenizer:
    """Words with their leading space, single digits, punctuation and whitespace; id 0 is a
    BOS. ``chat=True`` adds a chat template whose markers are single special tokens."""

    PIECE = re.compile(r"<s>|<\|\w+\|>| ?[A-Za-z]+| ?[0-9]| ?[^A-Za-z0-9\s]|\s")

    def __init__(self, chat: bool = False) -> None:
        self.strings = ["<s>"]
        self.ids = {"<s>": 0}
        if chat:
            self.chat_template = "<|user|> … <|end|> <|assistant|>"

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        pieces = self.PIECE.findall(text)
        assert "".join(pieces) == text
        for p in pieces:
            if p not in self.ids:
                self.ids[p] = len(self.strings)
                self.strings.append(p)
        return {"input_ids": [0] * add_special_tokens + [self.ids[p] for p in pieces]}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        out = (self.strings[i] for i in ids)
        return "".join(s for s in out if not (skip_special_tokens and s.startswith("<")))

    def apply_chat_template(self, messages: Any, **kwargs: Any) -> str:
        assert kwargs == {"tokenize": False, "add_generation_prompt": True}
        return f"<s><|user|>\n{messages[0]['content']}<|end|>\n<|assistant|>\n"


class Chars:
    """One id per character (newline 0, printable ASCII 1-95): fits the tiny models'
    vocabulary of 99 and decodes back exactly."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [0 if c == "\n" else ord(c) - 31 for c in text]}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join("\n" if i == 0 else chr(i + 31) if i < 96 else "?" for i in ids)


@pytest.fixture(scope="module")
def texts(fixture_data: Any) -> list[str]:
    """The made-up FineWeb-Edu records of tests/fixtures/data: 3 texts, 5 sentences."""
    return data.load_texts("fineweb-edu", data_dir=fixture_data)


def _ids(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _has(seq: list[int], sub: list[int]) -> bool:
    return any(seq[k : k + len(sub)] == sub for k in range(len(seq) - len(sub) + 1))


def check_item(item: Any, tok: Any, length: int) -> None:
    """The item read back: its length, its needles intact, its answers what the text says."""
    assert item.length == length
    assert item.prompt().shape == (1, length)
    context = item.context[0].tolist()
    text = tok.decode(context, skip_special_tokens=True)
    question = tok.decode(item.question[0].tolist(), skip_special_tokens=True)
    prefix = tok.decode(item.answer_prefix[0].tolist(), skip_special_tokens=True)
    assert item.max_new_tokens > len(_ids(tok, " " + ", ".join(item.answers)))
    if item.task in NIAH_SHAPE:
        keys, values, asked = NIAH_SHAPE[item.task]
        pattern = r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\."
        found = re.findall(pattern, text)
        assert len(found) == keys * values == len(item.meta["needles"])
        for needle in item.meta["needles"]:  # intact: its own ids, its own text
            assert _has(context, _ids(tok, " " + needle)) and needle in text
        assert len({k for k, _ in found}) == keys and len({v for _, v in found}) == keys * values
        asked_keys = item.meta["asked"]
        assert len(asked_keys) == asked and all(k in question and k in prefix for k in asked_keys)
        assert sorted(item.answers) == sorted(v for k, v in found if k in asked_keys)
        assert len(item.answers) == (values if item.task == "niah_multivalue" else asked)
        others = {k for k, _ in found} - set(asked_keys)  # multikey: the distractors
        assert len(others) == (3 if item.task == "niah_multikey" else 0)
        assert not any(k in question for k in others)
        assert 0 <= item.meta["depth"] <= 1
    elif item.task == "vt":
        assigned = dict(re.findall(r"VAR ([A-Z]{5}) = ((?:VAR [A-Z]{5})|\d{5})\.", text))
        assert len(assigned) == 5

        def resolve(name: str) -> str:
            value = assigned[name]
            return resolve(value[4:]) if value.startswith("VAR ") else value

        value = item.meta["value"]
        assert value in question and value in prefix
        assert sorted(item.answers) == sorted(n for n in assigned if resolve(n) == value)
    elif item.task == "cwe":
        entries = re.findall(r" (\d+)\. ([a-z]+)", text)
        assert [int(k) for k, _ in entries] == list(range(1, len(entries) + 1))
        counts = Counter(w for _, w in entries)
        assert len(item.answers) == CWE_COMMON == len(set(item.answers))
        others = [c for w, c in counts.items() if w not in item.answers]
        assert min(counts[w] for w in item.answers) > max(others, default=0)
        assert counts == Counter(item.meta["counts"])
    else:  # fwe
        body = text.split("coded words.", 1)[1]
        counts = Counter(w for w in body.split() if w != FWE_NOISE)
        top = counts.most_common(4)
        assert [w for w, _ in top[:3]] == list(item.answers)
        assert top[0][1] > top[1][1] > top[2][1] > top[3][1]
        assert counts[FWE_NOISE] == 0 and body.split().count(FWE_NOISE) > top[0][1]


#: two lengths per task that the fixture texts (75 haystack tokens here) can fill
LENGTHS = {"niah_single": (110, 135), "niah_multikey": (170, 195), "niah_multivalue": (170, 195),
           "niah_multiquery": (195, 220), "vt": (135, 160), "cwe": (300, 700),
           "fwe": (240, 400)}  # fmt: skip


@pytest.mark.parametrize("task", RULER_TASKS)
@pytest.mark.parametrize("chat", [False, True])
def test_items_have_the_length_asked_and_answers_the_text_bears_out(
    task: str, chat: bool, texts: list[str]
) -> None:
    tok = WordTokenizer(chat=chat)
    gen = RulerGenerator(tok, texts)
    assert gen.chat is chat
    for length in LENGTHS[task]:
        for index in range(3):
            item = gen.item(task, seed=5, length=length, index=index)
            check_item(item, tok, length)
            head = tok.decode(item.context[0, :3].tolist())
            assert head.startswith("<s><|user|>\n" if chat else "<s>")
            tail = tok.decode(item.answer_prefix[0].tolist())
            assert tail.startswith("<|end|>\n<|assistant|>\n") is chat


@pytest.mark.parametrize("task", RULER_TASKS)
def test_items_are_deterministic_by_seed(task: str, texts: list[str]) -> None:
    tok = WordTokenizer()
    length = LENGTHS[task][0]
    a = ruler_item(task, 3, length, tok, texts, index=1)
    b = RulerGenerator(tok, list(texts)).item(task, 3, length, index=1)
    for field in ("context", "question", "answer_prefix"):
        assert torch.equal(getattr(a, field), getattr(b, field))
    assert a.answers == b.answers and a.meta == b.meta
    c = ruler_item(task, 4, length, tok, texts, index=1)
    assert not torch.equal(a.context, c.context) and a.answers != c.answers
    d = ruler_item(task, 3, length, tok, texts, index=2)
    assert a.answers != d.answers


def test_niah_single_deals_its_depths_and_lands_near_them(texts: list[str]) -> None:
    tok = WordTokenizer()
    gen = RulerGenerator(tok, texts)
    items = [gen.item("niah_single", 0, 130, index=k) for k in range(10)]
    assert [it.meta["depth"] for it in items] == [round(0.05 + 0.1 * k, 2) for k in range(10)]
    for it in items:  # the nearest sentence boundary: within the longest fixture sentence
        assert abs(it.meta["depths"][0] - it.meta["depth"]) < 0.45


def test_the_haystack_is_the_texts_sentences_not_repeated(texts: list[str]) -> None:
    tok = WordTokenizer()
    known = [" ".join(s.split()) for t in texts for s in SPLIT.split(t.strip()) if s.strip()]
    for index in range(4):
        item = ruler_item("niah_multikey", 1, 190, tok, texts, index=index)
        text = tok.decode(item.context[0].tolist(), skip_special_tokens=True)
        body = text.split("afterwards.\n", 1)[1]
        for needle in item.meta["needles"]:
            body = body.replace(" " + needle, "")
        sentences = [" ".join(s.split()) for s in SPLIT.split(body.strip()) if s.strip()]
        assert len(sentences) >= 3
        *whole, cut = sentences
        assert all(s in known for s in whole)
        assert len(set(whole)) == len(whole)  # no sentence twice
        assert any(k.startswith(cut) for k in known)
        assert "The grass is green" not in body
    # all the texts hold fewer tokens than this item's haystack needs
    with pytest.raises(RulerError, match=r"haystack texts hold \d+ tokens, fewer than"):
        ruler_item("niah_single", 0, 400, tok, texts)


def test_a_length_too_short_for_the_template_and_needles_is_a_clear_error(
    texts: list[str],
) -> None:
    tok = WordTokenizer()
    with pytest.raises(RulerError, match=r"too short for its template and needles .* at least"):
        ruler_item("niah_multiquery", 0, 120, tok, texts)
    with pytest.raises(RulerError, match="too short"):
        ruler_item("cwe", 0, 80, tok)
    with pytest.raises(RulerError, match="too short"):
        ruler_item("fwe", 0, 60, tok)
    with pytest.raises(RulerError, match="needs haystack texts"):
        ruler_item("vt", 0, 300, tok)
    with pytest.raises(ValueError, match=r"unknown RULER task 'nope'; choose from niah_single"):
        ruler_item("nope", 0, 300, tok, texts)


def test_scoring_is_the_share_of_answers_found() -> None:
    assert string_match_all(" 1234567.", ["1234567"]) == 1.0
    assert string_match_all("The numbers are 1234567 and 7654321", ["1234567", "1111111"]) == 0.5
    assert string_match_all("APPLE, river", ["apple", "river", "stone"]) == pytest.approx(2 / 3)
    assert string_match_all("nothing", ["1234567"]) == 0.0


def test_kv_eval_runs_a_ruler_task_in_both_settings_and_resumes(
    tmp_path: Any, texts: list[str]
) -> None:
    from contribution_weights.experiments.kv_eval import (
        KVEvalOptions,
        KVEvalResult,
        kv_eval,
        shortfall,
    )

    model = tiny_model("llama")
    model.tokenizer = Chars()
    opts = KVEvalOptions(
        task="ruler", ruler_tasks="niah_single", settings="both", methods="h2o,snapkv",
        ratios=[0, 0.5], context_tokens=512, n=2, window=8,
    )  # fmt: skip
    first = kv_eval(model, texts, options=opts, out=tmp_path / "run", progress=False)
    rows = first.per_item
    assert len(rows) == 2 * 2 * 3  # items × settings × (none, h2o, snapkv)
    assert set(rows["setting"]) == {"query_agnostic", "query_aware"}
    assert set(rows["task"]) == {"niah_single"}
    assert set(zip(rows["method"], rows["ratio"], strict=True)) == {
        ("none", 0.0), ("h2o", 0.5), ("snapkv", 0.5)
    }  # fmt: skip
    assert rows["accuracy"].between(0, 1).all() and rows["answers"].astype(str).str.len().min() == 7
    tokens = rows.groupby("setting")["prefill_tokens"].first()
    assert tokens["query_agnostic"] < tokens["query_aware"] < 512  # the question prefilled
    summary = first.summary
    assert list(summary.columns) == ["method", "task", "setting", "ratio", "n", "accuracy_mean",
                                     "accuracy_se", "uncompressed_accuracy", "compress_s",
                                     "kept_mib"]  # fmt: skip
    assert len(summary) == 6 and (summary["n"] == 2).all()
    for setting, group in summary.groupby("setting"):
        none = group[group["method"] == "none"]["accuracy_mean"].item()
        assert (group["uncompressed_accuracy"] == none).all(), setting
    paired = first.paired()
    assert set(paired["setting"]) == {"query_agnostic", "query_aware"}
    assert (paired[paired["method"] == "none"]["delta_mean"] == 0).all()
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["settings"] == ["query_agnostic", "query_aware"]
    assert config["ruler_tasks"] == ["niah_single"]
    for name in ("summary_depth.csv", "summary_pairs.csv", "summary_ranking.csv",
                 "summary_vs_uncompressed.csv", "summary_settings.csv"):  # fmt: skip
        assert (tmp_path / "run" / name).exists(), name
    ranking = first.ranking()
    assert set(ranking["method"]) == {"h2o", "snapkv"} and set(ranking["ratio"]) == {0.5}
    # tables.md: a section per (task, setting), a row per method from the ranking
    tables = (tmp_path / "run" / "tables.md").read_text()
    assert tables == first.markdown() + "\n"
    assert "## niah_single, query_agnostic" in tables and "## niah_single, query_aware" in tables
    for r in ranking.itertuples():
        row = f"| `{r.method}` | {r.mean:.2f} ± {r.se:.2f} | {r.wins} / {r.losses} |"
        assert row in tables, row
    assert tables.count("Uncompressed: ") == 2 and tables.count("MiB kept") == 2
    figure = plot(first)
    titles = {ax.get_title() for ax in figure.axes if ax.get_title()}
    assert titles == {"niah_single · query-agnostic · n=2", "niah_single · query-aware · n=2"}
    from contribution_weights.experiments.spec import EXPERIMENTS
    from contribution_weights.presentation.figures import figure_for

    # the command writes it: the name the CLI saves it under, and a figure function
    assert EXPERIMENTS.get("kv-eval").figure_name(first) == "kv-accuracy.png"
    assert figure_for(first) is not None
    # the pairs read back from their CSV rank as the ones in memory
    pairs_csv = pd.read_csv(tmp_path / "run" / "summary_pairs.csv")
    pd.testing.assert_frame_equal(first.ranking(pairs_csv), first.ranking(), check_dtype=False)
    # a random tiny model cannot do the task: the notes say so
    notes = shortfall(first)
    assert all("cannot do this task" in line for line in notes)
    assert len(notes) == int((summary.query("method == 'none'")["accuracy_mean"] < 0.1).sum())
    again = kv_eval(model, texts, options=opts, out=tmp_path / "run", resume=True, progress=False)
    assert len(again.per_item) == len(rows)  # nothing redone, nothing lost
    pd.testing.assert_frame_equal(again.summary, summary, check_dtype=False)
    loaded = KVEvalResult.load(tmp_path / "run")
    pd.testing.assert_frame_equal(loaded.summary, summary, check_dtype=False)


def test_the_ruler_figure_keeps_each_methods_colour_and_legend_across_panels() -> None:
    """A method missing from one panel (here "a" in vt) shifts neither the others' colours
    nor the legend, which lists every method once."""
    from contribution_weights.presentation.kv_plots import plot_ruler

    rows = []
    for task, methods in (("niah_single", ["a", "b", "c"]), ("vt", ["b", "c"])):
        rows.append({"method": "none", "task": task, "setting": "query_aware", "ratio": 0.0,
                     "n": 3, "accuracy_mean": 0.9, "accuracy_se": 0.1})  # fmt: skip
        for k, m in enumerate(methods):
            rows.append({"method": m, "task": task, "setting": "query_aware", "ratio": 0.5,
                         "n": 3, "accuracy_mean": 0.2 * k, "accuracy_se": 0.1})  # fmt: skip
    figure = plot_ruler(pd.DataFrame(rows))
    colours: dict[str, set[str]] = {}
    for ax in figure.axes:
        for bars in ax.containers:  # one errorbar container per method and panel
            colours.setdefault(bars.get_label(), set()).add(str(bars.lines[0].get_color()))
    assert set(colours) == {"a", "b", "c"} and all(len(c) == 1 for c in colours.values())
    legend = [t.get_text() for ax in figure.axes if ax.get_legend() for t in ax.get_legend().texts]
    assert legend == ["a", "b", "c"]


def test_method_pairs_and_ranking_find_a_known_winner_per_task_and_setting() -> None:
    """Synthetic rows with a known answer: in niah_single "good" finds every needle and
    "bad" none, so good beats bad, and the coin flip "coin" loses to good and beats bad
    (n = 60); in vt every method scores the same, so all tie."""
    from contribution_weights.experiments.kv_eval import method_pairs, method_ranking

    rng = np.random.default_rng(0)
    rows = []
    for task in ("niah_single", "vt"):
        for i in range(60):
            rows.append({"item": i, "task": task, "setting": "query_agnostic", "method": "none",
                         "ratio": 0.0, "accuracy": 1.0})  # fmt: skip
            coin = float(rng.integers(0, 2))
            scores = {"good": 1.0, "bad": 0.0, "coin": coin} if task == "niah_single" else {
                "good": 0.5, "bad": 0.5, "coin": 0.5}  # fmt: skip
            for method, accuracy in scores.items():
                rows.append({"item": i, "task": task, "setting": "query_agnostic",
                             "method": method, "ratio": 0.5, "accuracy": accuracy})  # fmt: skip
    per_item = pd.DataFrame(rows)
    pairs = method_pairs(per_item, "ruler")
    assert "none" not in set(pairs["reference"]) | set(pairs["other"])
    verdict = {(r.task, r.reference, r.other): r.verdict for r in pairs.itertuples()}
    assert verdict["niah_single", "good", "bad"] == "reference better"
    assert verdict["niah_single", "good", "coin"] == "reference better"
    assert verdict["niah_single", "bad", "coin"] == "other better"
    assert {v for (task, _, _), v in verdict.items() if task == "vt"} == {"tie"}
    ranking = method_ranking(per_item, "ruler", pairs).set_index(["task", "method"])
    assert ranking.loc[("niah_single", "good"), ["wins", "losses"]].tolist() == [2, 0]
    assert ranking.loc[("niah_single", "bad"), ["wins", "losses"]].tolist() == [0, 2]
    assert (ranking.loc["vt", "ties"] == 2).all()
    # language modelling: a lower NLL is the better one
    lm = per_item[per_item["task"] == "niah_single"].rename(columns={"accuracy": "nll"})
    lm_pairs = method_pairs(lm.drop(columns=["task", "setting"]), "lm")
    good_bad = lm_pairs[(lm_pairs["reference"] == "good") & (lm_pairs["other"] == "bad")]
    assert good_bad["verdict"].item() == "other better"
    # read back from summary_pairs.csv, the empty setting is NaN: the ranking is the same
    import io

    back = pd.read_csv(io.StringIO(lm_pairs.to_csv(index=False)))
    assert back["setting"].isna().all()
    lm_rows = lm.drop(columns=["task", "setting"])
    pd.testing.assert_frame_equal(
        method_ranking(lm_rows, "lm", back), method_ranking(lm_rows, "lm", lm_pairs)
    )
    assert method_ranking(lm_rows, "lm", back).set_index("method").loc["bad", "wins"] == 2


def test_caches_generated_together_give_each_its_own_generation(texts: list[str]) -> None:
    """ruler_scores stacks the compressed caches of one prefill as batch rows: the text of
    each row is that of its own generation (float64, so no rounding can flip a greedy
    choice), a row that ends early is cut at its end-of-sequence token while the others go
    on, and the caches are left as they were. A random tiny model writes the same text
    from most caches, so one cache is scaled until it writes another."""
    from contribution_weights.kv import compress, prefill
    from contribution_weights.kv.cache import stack_caches
    from contribution_weights.kv.ruler import ruler_score, ruler_scores

    model = tiny_model("llama", dtype=torch.float64)
    model.tokenizer = Chars()
    item = ruler_item("niah_single", 0, 512, Chars(), texts)
    pre = prefill(model, item.prefill_ids("query_agnostic"), 8, methods=["h2o", "snapkv"])

    def fresh() -> list[Any]:  # generating extends a cache: each run gets new copies
        caches = [compress(pre, m, 0.5) for m in ("h2o", "snapkv", "h2o")]
        for layer in caches[2].cache.layers:
            layer.keys, layer.values = layer.keys * 40, layer.values * 40
        return caches

    first = [ruler_score(model, c, item, "query_agnostic")["output"] for c in fresh()]
    assert first[0] != first[2], first  # rows the test can tell apart
    # the last row's first character ends a sequence: that row stops at once, the others
    # (which never write it) run to the token limit
    model.model.generation_config.eos_token_id = Chars()(first[2][0])["input_ids"][0]
    alone = [ruler_score(model, c, item, "query_agnostic") for c in fresh()]
    assert alone[2]["output"] == first[2][0] and alone[0]["output"] == first[0]
    caches = fresh()
    assert ruler_scores(model, caches, item, "query_agnostic") == alone
    for got, want in zip(caches, fresh(), strict=True):  # the stacked rows were copies
        for a, b in zip(got.cache.layers, want.cache.layers, strict=True):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    with pytest.raises(ValueError, match="stack only when"):
        stack_caches([caches[0], compress(pre, "h2o", 0.25)])


def test_ruler_rows_do_not_depend_on_how_many_generate_together(
    texts: list[str], monkeypatch: Any
) -> None:
    from contribution_weights.experiments.kv_eval import KVEvalOptions, ruler_rows
    from contribution_weights.experiments.kv_eval import run as kv_module  # patched where looked up

    model = tiny_model("llama", dtype=torch.float64)
    model.tokenizer = Chars()
    item = ruler_item("niah_single", 0, 512, Chars(), texts)
    opts = KVEvalOptions(
        task="ruler", ruler_tasks="niah_single", methods="h2o,snapkv,tova,adakv_snapkv",
        ratios=[0, 0.25, 0.5], context_tokens=512, n=1, window=8,
    )  # fmt: skip
    rows = {}
    for batch in (1, 2, 12):
        monkeypatch.setattr(kv_module, "GENERATE_BATCH", batch)
        rows[batch] = [
            {k: v for k, v in r.items() if k not in ("prefill_s", "compress_s")}
            for r in ruler_rows(model, item, opts)
        ]
    assert rows[1] == rows[2] == rows[12]
    assert [(r["method"], r["ratio"]) for r in rows[12]] == opts.configurations()


def test_ruler_options_are_checked(tmp_path: Any, capsys: Any) -> None:
    from contribution_weights.cli import main
    from contribution_weights.experiments.options import KVEvalOptions

    opts = KVEvalOptions(task="ruler", ruler_tasks="vt, niah_single,vt", settings="both")
    assert opts.ruler_tasks == ["vt", "niah_single"]
    assert opts.settings == ["query_agnostic", "query_aware"]
    assert KVEvalOptions(task="ruler").ruler_tasks == list(RULER_TASKS)
    with pytest.raises(ValueError, match=r"unknown ruler task 'nope'; choose from niah_single"):
        KVEvalOptions(task="ruler", ruler_tasks="niah_single,nope")
    with pytest.raises(ValueError, match=r"unknown ruler tasks 'niah', 'nope'; choose from"):
        KVEvalOptions(task="ruler", ruler_tasks="niah,niah_single,nope")
    with pytest.raises(ValueError, match=r"unknown setting 'sideways'; choose from query_agn"):
        KVEvalOptions(task="ruler", settings="sideways")
    with pytest.raises(ValueError, match="applies to --task ruler only"):
        KVEvalOptions(task="passkey", settings="query_aware")
    with pytest.raises(ValueError, match="applies to --task ruler only"):
        KVEvalOptions(task="lm", ruler_tasks="vt")
    with pytest.raises(ValueError, match="needs ratio 0"):
        KVEvalOptions(task="ruler", ratios=[0.5])
    out = str(tmp_path / "o")
    assert main(["kv-eval", "--task", "ruler", "--ruler-tasks", "zzz", "--out", out]) == 2
    assert "unknown ruler task 'zzz'" in capsys.readouterr().err
    assert main(["kv-eval", "--task", "ruler", "--setting", "both,up", "--out", out]) == 2
    assert "unknown setting 'up'" in capsys.readouterr().err


def test_a_ruler_run_too_short_for_its_needles_fails_before_any_prefill(
    texts: list[str], monkeypatch: Any
) -> None:
    from contribution_weights.experiments.kv_eval import run as kv_module  # patched where looked up

    model = tiny_model("llama")
    model.tokenizer = Chars()
    monkeypatch.setattr(kv_module, "prefill", lambda *a, **k: pytest.fail("prefilled"))
    opts = kv_module.KVEvalOptions(
        task="ruler", ruler_tasks="niah_multikey", ratios=[0, 0.5], context_tokens=256, n=1,
        window=8, methods="h2o",
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"niah_multikey item of 256 tokens is too short"):
        kv_module.kv_eval(model, texts, options=opts, progress=False)
    with pytest.raises(ValueError, match="haystack from texts"):
        kv_module.kv_eval(model, None, options=opts, progress=False)


@pytest.mark.slow
def test_items_survive_the_real_tokenizer(smollm2: Any, texts: list[str]) -> None:
    """SmolLM2's BPE tokenizer and chat template, on the fixture texts."""
    tok = smollm2.tokenizer
    gen = RulerGenerator(tok, texts)
    assert gen.chat
    lengths = {"niah_single": 160, "niah_multikey": 230, "niah_multivalue": 230,
               "niah_multiquery": 260, "vt": 220, "cwe": 600, "fwe": 400}  # fmt: skip
    for task in RULER_TASKS:
        for index in range(2):
            check_item(gen.item(task, 0, lengths[task], index=index), tok, lengths[task])


@pytest.mark.slow
def test_items_at_4096_tokens_on_the_real_data(smollm2: Any, shared_data: Any) -> None:
    texts = data.load_texts("fineweb-edu", data_dir=shared_data)
    tok = smollm2.tokenizer
    gen = RulerGenerator(tok, texts)
    for task in RULER_TASKS:
        for index in range(3):
            item = gen.item(task, 0, 4096, index=index)
            check_item(item, tok, 4096)
            if task in NIAH_SHAPE or task == "vt":
                for got, want in zip(item.meta["depths"], item.meta["nominal_depths"], strict=True):
                    assert abs(got - want) < 0.05


def test_methods_against_the_uncompressed_cache_and_the_settings_are_tested_item_by_item():
    """``uncompressed_pairs``: method − uncompressed on the same items and setting, sign
    test, Holm over methods × ratios of the setting, ``worse`` where lower; ``setting_pairs``:
    query-aware − query-agnostic per method and ratio, ``better`` where higher."""
    from contribution_weights.experiments.kv_eval import setting_pairs, uncompressed_pairs

    rows = []
    for item in range(12):
        for setting in ("query_agnostic", "query_aware"):
            common = {"item": item, "task": "niah_single", "setting": setting}
            rows += [
                {**common, "method": "none", "ratio": 0.0, "accuracy": 1.0},
                {**common, "method": "snapkv", "ratio": 0.5,
                 "accuracy": float(setting == "query_aware")},
                {**common, "method": "h2o", "ratio": 0.5, "accuracy": float(item % 2)},
            ]  # fmt: skip
    versus = uncompressed_pairs(pd.DataFrame(rows), "ruler").set_index(["setting", "method"])
    snap, h2o = versus.loc[("query_agnostic", "snapkv")], versus.loc[("query_agnostic", "h2o")]
    assert snap["mean"] == -1 and snap["p"] == pytest.approx(2 * 0.5**12)
    assert snap["p_holm"] == pytest.approx(2 * snap["p"])  # two comparisons in the setting
    assert h2o["mean"] == -0.5 and h2o["p"] == pytest.approx(2 * 0.5**6)
    assert snap["verdict"] == h2o["verdict"] == "worse"
    assert versus.loc[("query_aware", "snapkv"), "verdict"] == "tie"  # no difference at all
    settings = setting_pairs(pd.DataFrame(rows)).set_index("method")
    assert settings.loc["snapkv", "mean"] == 1 and settings.loc["snapkv", "verdict"] == "better"
    assert (settings.loc[["none", "h2o"], "verdict"] == "tie").all()
