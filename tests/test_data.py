"""cw.data: the data directory (made-up fixtures, and the real data where present), plain
files, and the offline error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contribution_weights import data
from contribution_weights.data import ChoiceItem, DataError


def test_gsm8k_is_question_newline_answer(fixture_data):
    texts = data.load_texts("gsm8k", 2, fixture_data)
    first = json.loads((fixture_data / "gsm8k" / "test.jsonl").open().readline())
    assert len(texts) == 2
    assert texts[0] == first["question"] + "\n" + first["answer"]
    assert all("####" in t for t in texts)
    assert len(data.load_texts("gsm8k", None, fixture_data)) == 3


def test_fineweb_edu_all_and_first_n(fixture_data):
    all_texts = data.load_texts("fineweb-edu", data_dir=fixture_data)
    assert len(all_texts) == 3  # the blank record is left out
    assert all_texts[0].startswith("Rivers carry sediment")
    assert all_texts[2].startswith("The printing press")
    assert data.load_texts("fineweb_edu", 2, fixture_data) == all_texts[:2]


def test_env_var_is_the_default_data_dir(fixture_data, monkeypatch):
    monkeypatch.setenv("CW_DATA_DIR", str(fixture_data))
    assert data.load_texts("gsm8k", 1) == data.load_texts("gsm8k", 1, fixture_data)


def test_mmlu_items_interleave_subjects(fixture_data):
    items = data.load_task("mmlu", None, fixture_data)
    assert len(items) == 3
    assert [i.options for i in items] == [[" A", " B", " C", " D"]] * 3
    # subjects in turn: astronomy, world history, then astronomy's second row
    assert "about astronomy.\n\nWhich planet" in items[0].prompt
    assert "about world history." in items[1].prompt and "Moon" in items[2].prompt
    assert items[0].prompt.endswith("\nAnswer:")
    assert items[0].answer == 1 and "\nB. Mercury\n" in items[0].prompt
    assert [i.answer for i in items] == [1, 3, 2]


def test_winogrande_options_fill_the_blank(fixture_data):
    first, second = data.load_task("winogrande", 2, fixture_data)
    assert first.prompt == "The trophy did not fit in the case because"
    assert first.options == [" the trophy was too big.", " the case was too big."]
    assert first.answer == 0
    assert second.answer == 1 and second.prompt.startswith("Anna lent Beth")


def test_boolq_yes_no(fixture_data):
    items = data.load_task("boolq", None, fixture_data)
    assert all(i.options == [" no", " yes"] and i.prompt.endswith("?\nAnswer:") for i in items)
    assert items[0].prompt == (
        "The Sun is the star at the centre of the Solar System.\n"
        "Question: Is the sun a star?\nAnswer:"
    )
    assert [i.answer for i in items] == [1, 0, 1]  # "true", "false", and a JSON boolean


def test_the_real_data_sets_load(shared_data):
    """The real samples beside the repository (skips without them)."""
    texts = data.load_texts("gsm8k", 3, shared_data)
    first = json.loads((shared_data / "gsm8k" / "test.jsonl").open().readline())
    assert texts[0] == first["question"] + "\n" + first["answer"]
    assert len(data.load_texts("fineweb-edu", data_dir=shared_data)) == 150
    mmlu = data.load_task("mmlu", 4, shared_data)
    assert "abstract algebra" in mmlu[0].prompt and "anatomy" in mmlu[1].prompt
    wino = data.load_task("winogrande", 1, shared_data)[0]
    assert wino.prompt == "Sarah was a much better surgeon than Maria so" and wino.answer == 1
    items = data.load_task("boolq", 20, shared_data)
    rows = [json.loads(x) for x in (shared_data / "boolq" / "val.jsonl").open().readlines()[:20]]
    assert [i.answer for i in items] == [int(r["label"] == "true") for r in rows]


def test_read_texts_jsonl_and_txt(tmp_path):
    j = tmp_path / "a.jsonl"
    j.write_text('{"text": "one"}\n\n{"text": "two", "body": "b"}\n')
    assert data.read_texts(j) == ["one", "two"]
    with pytest.raises(DataError, match="--field"):
        data.read_texts(j, field="body")
    t = tmp_path / "a.txt"
    t.write_text("first para\nline 2\n\n\nsecond\n")
    assert data.read_texts(t) == ["first para\nline 2", "second"]
    single = tmp_path / "b.txt"
    single.write_text("just one text\nover two lines\n")
    assert data.read_texts(single) == ["just one text\nover two lines"]
    with pytest.raises(DataError, match="does not exist"):
        data.read_texts(tmp_path / "none.jsonl")
    bad = tmp_path / "c.csv"
    bad.write_text("x")
    with pytest.raises(DataError, match=r"\.jsonl or \.txt"):
        data.read_texts(bad)


def test_offline_without_data_says_where_to_put_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("CW_DATA_DIR", raising=False)
    with pytest.raises(DataError) as err:
        data.load_texts("gsm8k", 2, tmp_path)
    msg = str(err.value)
    assert "gsm8k/test.jsonl" in msg and "CW_DATA_DIR" in msg and "--data-dir" in msg
    with pytest.raises(DataError, match=r"boolq/val\.jsonl"):
        data.load_task("boolq")
    with pytest.raises(DataError, match="does not exist"):
        data.load_texts("gsm8k", data_dir=tmp_path / "missing")


def test_unknown_names_and_bad_n(fixture_data):
    with pytest.raises(ValueError, match="gsm8k, fineweb-edu"):
        data.load_texts("wikitext", data_dir=fixture_data)
    with pytest.raises(ValueError, match="mmlu, winogrande, boolq"):
        data.load_task("hellaswag", data_dir=fixture_data)
    with pytest.raises(ValueError, match="positive"):
        data.load_texts("gsm8k", 0, fixture_data)


def test_choice_item_is_plain_data():
    item = ChoiceItem("p", [" a", " b"], 1)
    assert item.options[item.answer] == " b"


def test_a_malformed_record_names_the_file_the_record_and_the_field(tmp_path):
    (tmp_path / "winogrande").mkdir()
    wino = tmp_path / "winogrande" / "dev.jsonl"
    good = {"sentence": "The cup fell because _ was full.", "option1": "it", "option2": "he",
            "answer": "1"}  # fmt: skip
    bad = {k: v for k, v in good.items() if k != "option2"}
    wino.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    assert len(data.load_task("winogrande", 1, tmp_path)) == 1
    with pytest.raises(DataError, match=rf"{wino}:2: the record has no field 'option2'"):
        data.load_task("winogrande", None, tmp_path)
    (tmp_path / "gsm8k").mkdir()
    gsm = tmp_path / "gsm8k" / "test.jsonl"
    gsm.write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(DataError, match=rf"{gsm}:1: the record has no field 'answer'"):
        data.load_texts("gsm8k", None, tmp_path)
    (tmp_path / "mmlu" / "test").mkdir(parents=True)
    csv_file = tmp_path / "mmlu" / "test" / "x_test.csv"
    csv_file.write_text("question,choice0,choice1,choice2,choice3,answer\nq,a,b,c,d,two\n")
    with pytest.raises(DataError, match=rf"{csv_file}:2: bad value"):
        data.load_task("mmlu", None, tmp_path)


# ---- each command's no-data message names only that command's options -------------------
def _options_of(command: str) -> set[str]:
    import argparse

    from contribution_weights.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return set(sub.choices[command]._option_string_actions)


@pytest.mark.parametrize(
    ("argv", "own"),
    [
        (["faithfulness", "--dataset", "gsm8k"], ["--texts", "--file"]),
        (["geometry", "--dataset", "fineweb-edu"], ["--texts", "--file"]),
        (["kv-eval", "--dataset", "gsm8k"], ["--texts", "--task"]),
        (["downstream", "--task", "boolq"], ["--items"]),
    ],
)
def test_no_data_message_suggests_only_options_the_command_accepts(
    argv, own, tmp_path, monkeypatch, capsys
):
    import re

    from contribution_weights.cli import main

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.delenv("CW_DATA_DIR", raising=False)
    monkeypatch.setattr(
        "contribution_weights.loading.load_model", lambda *a, **k: pytest.fail("loaded a model")
    )
    assert main([*argv, "--data-dir", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "no " in err and "data found" in err and "--data-dir DIR" in err
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", err))
    assert named <= _options_of(argv[0]), f"{named - _options_of(argv[0])} in: {err}"
    assert set(own) <= named


def test_the_api_message_names_the_api():
    err = data.MissingDataError("mmlu", Path("D") / "mmlu", "")
    assert "read_items(path, task)" in str(err) and "data_dir=" in str(err)
    assert "read_texts(path)" in str(data.MissingDataError("gsm8k", Path("x"), ""))
    import pickle

    assert str(pickle.loads(pickle.dumps(err))) == str(err)


# ---- the user's own task items -------------------------------------------------------------
def test_own_items_in_each_task_format_read_as_the_data_folder_does(fixture_data, tmp_path):
    for task, file in [("winogrande", "winogrande/dev.jsonl"), ("boolq", "boolq/val.jsonl")]:
        assert data.read_items(fixture_data / file, task) == data.load_task(
            task, None, fixture_data
        )
    mmlu = data.load_task("mmlu", None, fixture_data)
    rows = []
    for name, per_subject in [("astronomy", [0, 2]), ("world_history", [1])]:
        for k in per_subject:
            item = mmlu[k]
            question = item.prompt.split("\n\n", 1)[1].split("\nA. ")[0]
            choices = [line[3:] for line in item.prompt.splitlines()[-5:-1]]
            rows.append({"subject": name, "question": question, "choices": choices,
                         "answer": item.answer})  # fmt: skip
    own = tmp_path / "mmlu.jsonl"
    own.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert data.read_items(own, "mmlu") == [mmlu[0], mmlu[2], mmlu[1]]
    assert data.read_items(own, "mmlu", n=1) == [mmlu[0]]


def test_own_items_in_their_own_words(tmp_path):
    f = tmp_path / "items.jsonl"
    f.write_text(json.dumps({"prompt": "2 + 2 =", "options": [" 3", " 4", " 5"], "answer": 1}))
    assert data.read_items(f, "mmlu") == [ChoiceItem("2 + 2 =", [" 3", " 4", " 5"], 1)]
    f.write_text(json.dumps({"prompt": "p", "options": [" a", " b"], "answer": 2}))
    with pytest.raises(DataError, match=rf"{f}:1: .*'answer' 2 is not an index of the 2"):
        data.read_items(f, "boolq")


def test_own_items_missing_a_field_name_it_the_line_and_the_fields_expected(tmp_path):
    f = tmp_path / "items.jsonl"
    good = {"sentence": "The cup fell because _ was full.", "option1": "it", "option2": "he",
            "answer": "1"}  # fmt: skip
    bad = {k: v for k, v in good.items() if k != "option2"}
    f.write_text(json.dumps(good) + "\n\n" + json.dumps(bad) + "\n")
    with pytest.raises(DataError) as err:
        data.read_items(f, "winogrande")
    msg = str(err.value)
    assert f"{f}:3: the item has no field 'option2'" in msg
    assert "needs the fields sentence, option1, option2, answer" in msg
    assert "prompt, options, answer" in msg
    f.write_text(json.dumps({"question": "q", "choices": ["a", "b"], "answer": 0}) + "\n")
    with pytest.raises(DataError, match="list of 4 choices"):
        data.read_items(f, "mmlu")
    f.write_text(json.dumps({"question": "is it", "passage": "p", "answer": True}) + "\n")
    assert data.read_items(f, "boolq")[0].answer == 1  # BoolQ's label may be named answer
    with pytest.raises(DataError, match="does not exist"):
        data.read_items(tmp_path / "none.jsonl", "boolq")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="holds no items"):
        data.read_items(tmp_path / "empty.jsonl", "boolq")


def test_fewer_texts_than_asked_for_are_announced(tmp_path, capsys):
    """`--n 50` on a file of 2 texts runs on those 2 and says so (blank blocks are no texts)."""
    import argparse

    from contribution_weights.cli.common import load_corpus

    path = tmp_path / "t.txt"
    path.write_text("one text\n\n\n\nanother text\n")
    args = argparse.Namespace(n=50, dataset=None, texts=None, file=path, field="text")
    texts, source = load_corpus(args)
    assert texts == ["one text", "another text"] and source == str(path)
    assert "only 2 texts in" in capsys.readouterr().err
    args.n = 2
    load_corpus(args)
    assert capsys.readouterr().err == ""
