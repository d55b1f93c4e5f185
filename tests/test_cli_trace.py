"""``cw trace`` and ``cw measures`` end to end, on a tiny model saved to a folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny

import contribution_weights as cw
from contribution_weights.cli import main


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny("qwen2", tmp_path_factory.mktemp("tiny-qwen2"))


def test_trace_writes_all_outputs(tiny_folder, tmp_path, capsys):
    out = tmp_path / "run"
    text = "The cat sat on the mat."
    code = main(["trace", "--text", text, "--model", str(tiny_folder), "--out", str(out)])
    assert code == 0
    for name in ["vectors.safetensors", "tokens.json", "summary.json", "heatmaps.png"]:
        assert (out / name).stat().st_size > 0, name
    assert (out / "first_token_weight.png").stat().st_size > 0
    tokens = json.loads((out / "tokens.json").read_text())
    model = cw.load_model(str(tiny_folder))
    ids = model.tokenizer("The cat sat on the mat.")["input_ids"]
    assert tokens["ids"] == ids
    assert tokens["tokens"] == [model.tokenizer.decode([i]) for i in ids]
    t = len(ids)
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) >= {"attention", "contribution", "vw"}
    assert 0 <= summary["attention"]["first_token_weight"] <= 1
    printed = capsys.readouterr().out
    assert "first_token_weight" in printed and "contribution" in printed

    from safetensors.torch import load_file

    shard = load_file(str(out / "maps" / "layer-000.safetensors"))
    assert set(shard) == {"attention", "intra", "projection"}  # the rest is derived
    assert shard["projection"].dtype == torch.float32
    assert shard["projection"].shape == (4, t * (t + 1) // 2)  # packed lower triangles
    assert load_file(str(out / "vectors.safetensors"))["bias_share"].shape == (2, t)
    # the streamed trace reloads and equals an in-memory trace of the same text, bit for bit
    reloaded = cw.Trace.load(out)
    fresh = cw.trace(model, "The cat sat on the mat.")
    assert reloaded.measures == fresh.measures
    for name in fresh.measures:
        assert torch.equal(reloaded[name].tensor(), fresh[name].tensor()), name
    assert reloaded.tokens == fresh.tokens and reloaded.layers == [0, 1]
    for flag in ("degenerate", "degenerate_heads", "zero_values"):
        assert torch.equal(getattr(reloaded, flag), getattr(fresh, flag)), flag
    assert reloaded.zero_values is not None and not reloaded.zero_values.any()


def test_trace_layers_measures_and_heads(tiny_folder, tmp_path):
    out = tmp_path / "run"
    args = ["trace", "--text", "abcdefgh", "--model", str(tiny_folder), "--out", str(out)]
    args += ["--measures", "attention,contribution", "--layers", "-1", "--heads", "1:2"]
    assert main(args) == 0
    trace = cw.Trace.load(out)
    assert trace.layers == [1]
    assert list(trace.measures) == ["attention", "contribution"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--measures", "attention,nope"], "valid measures: attention"),
        (["--layers", "7"], "out of range"),
        (["--max-tokens", "3"], "--truncate"),
        (["--kernels", "triton"], "--no-maps"),  # the tiled kernels build no maps
        (["--kernels", "triton", "--no-maps", "--measures", "distance"], "does not compute"),
    ],
)
def test_trace_bad_input_names_the_fix(tiny_folder, tmp_path, capsys, extra, message):
    args = ["trace", "--text", "abcdefgh", "--model", str(tiny_folder), "--out", str(tmp_path)]
    assert main(args + extra) == 2
    assert message in capsys.readouterr().err


def test_truncate_keeps_first_tokens(tiny_folder, tmp_path):
    out = tmp_path / "run"
    args = ["trace", "--text", "abcdefgh", "--model", str(tiny_folder), "--out", str(out)]
    assert main([*args, "--max-tokens", "3", "--truncate", "--no-figures"]) == 0
    assert cw.Trace.load(out).num_tokens == 3


def test_wrote_line_names_every_file_in_the_folder(tiny_folder, tmp_path, capsys):
    """The "wrote …" line is read from the folder: reductions.safetensors was missing from
    a hand-kept list. A second trace into the folder lists only its own files."""
    out = tmp_path / "run"
    args = ["trace", "--text", "abcdefgh", "--model", str(tiny_folder), "--out", str(out)]
    for extra in ([], ["--no-maps", "--overwrite"], ["--no-figures", "--overwrite"]):
        assert main(args + extra) == 0, extra
        line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("wrote ")]
        assert len(line) == 1 and line[0].endswith(f" to {out}"), line
        listed = line[0].removeprefix("wrote ").removesuffix(f" to {out}").split(", ")
        on_disk = [p.name + ("/" if p.is_dir() else "") for p in out.iterdir()]
        assert sorted(listed) == sorted(on_disk), extra
        assert "reductions.safetensors" in listed
        assert ("maps/" in listed) == ("--no-maps" not in extra)


def test_missing_model_and_empty_text(tmp_path, capsys):
    assert main(["trace", "--text", "hi", "--model", str(tmp_path / "nope"), "--out", "x"]) == 2
    assert "not found" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    assert main(["trace", "--file", str(empty), "--model", str(tmp_path), "--out", "x"]) == 2
    assert "the text is empty" in capsys.readouterr().err  # found before loading the model


def test_measures_lists_registry(capsys):
    assert main(["measures"]) == 0
    printed = capsys.readouterr().out
    for name in cw.measure_names():
        assert name in printed
    # the columns are as wide as their longest entry: every description starts in line
    table = printed.split("\n\n")[0].splitlines()
    start = table[0].index("description")
    for line, name in zip(table[1:], cw.measure_names(), strict=True):
        description = cw.get_measure(name).description
        assert line.index(description) == start, line


@pytest.mark.slow
def test_demo_on_embedded_model(tmp_path, capsys, smollm2):
    out = tmp_path / "demo"
    assert main(["trace", "--example", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    # the embedded model's sink: attention puts more weight on token 0 than contribution
    assert (
        summary["attention"]["first_token_weight"] > summary["contribution"]["first_token_weight"]
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0,5,-1", [0, 5, -1]), ("0-3", [0, 1, 2, 3]), ("-3--1", [-3, -2, -1]), ("2", [2])],
)
def test_parse_int_list(text, expected):
    from contribution_weights.cli.common import parse_int_list

    assert parse_int_list(text) == expected


@pytest.mark.parametrize("text", ["a", "3-1", "1-2-3"])
def test_parse_int_list_rejects_with_syntax(text):
    import argparse

    from contribution_weights.cli.common import parse_int_list

    with pytest.raises(argparse.ArgumentTypeError, match=r"0-3|empty"):
        parse_int_list(text)


# ---- errors before the work: exit 2 before the model loads ---------------------------------
@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if a command loads a model."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was reported")

    monkeypatch.setattr("contribution_weights.loading.load_model", refuse)


def _bad_outs(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    return {
        "existing file": (a_file, "is an existing file"),
        "under a file": (a_file / "sub", "is a file, not a folder"),
        "unwritable": (Path("/sys/cw-test-out"), "cannot be created in /sys"),
    }


@pytest.mark.parametrize("case", ["existing file", "under a file", "unwritable"])
@pytest.mark.parametrize(
    "command",
    [
        ["trace", "--text", "abc"],
        ["faithfulness", "--texts", "{texts}"],
        ["geometry", "--texts", "{texts}"],
        ["downstream", "--task", "boolq", "--data-dir", "{data}"],
    ],
    ids=lambda c: c[0],
)
def test_bad_out_folder_exits_2_before_loading(
    tmp_path, capsys, no_loading, fixture_data, case, command
):
    texts = tmp_path / "t.jsonl"
    texts.write_text('{"text": "one two three"}\n')
    out, message = _bad_outs(tmp_path)[case]
    argv = [a.format(texts=texts, data=fixture_data) for a in command]
    assert main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}" in err and message in err, err


@pytest.mark.parametrize(
    ("out", "message"),
    [
        ("folder", "is a folder; give a file name"),
        ("a-file/report.html", "is a file, not a folder"),
        ("/sys/cw-test/report.html", "cannot be created in /sys"),
    ],
)
def test_report_bad_out_exits_2_before_tracing(tmp_path, capsys, no_loading, out, message):
    (tmp_path / "folder").mkdir()
    (tmp_path / "a-file").write_text("x")
    target = Path(out) if out.startswith("/") else tmp_path / out
    assert main(["report", "--text", "abc", "--out", str(target)]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("heads", "extra", "message"),
    [
        ("5:0", [], "layer 5 does not exist; the model has 2 layers (0..1"),
        ("-3:0", [], "layer -3 does not exist"),
        ("1:4", [], "head 4 does not exist; the model has 4 heads per layer (0..3)"),
        ("0:1", ["--layers", "1"], "layer 0 is not traced (--layers gives 1)"),
        ("", ["--layers", "7"], "layer 7 is out of range: the model has 2 layers"),
        ("", ["--measures", "attention,nope"], "valid measures: attention"),
    ],
)
def test_bad_heads_and_layers_exit_2_before_loading(
    tiny_folder, tmp_path, capsys, no_loading, heads, extra, message
):
    argv = ["trace", "--text", "abc", "--model", str(tiny_folder), "--out", str(tmp_path / "o")]
    assert main([*argv, *([f"--heads={heads}"] if heads else []), *extra]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_heads_syntax_is_checked_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        main(["trace", "--text", "abc", "--heads", "1:x", "--out", "o"])
    assert "'1:x' is not LAYER:HEAD" in capsys.readouterr().err


def test_heads_are_checked_after_loading_when_no_config_is_at_hand(
    tiny_folder, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr("contribution_weights.loading.peek_dims", lambda name: None)
    argv = ["trace", "--text", "abc", "--model", str(tiny_folder), "--out", str(tmp_path / "o")]
    assert main([*argv, "--heads", "0:7"]) == 2
    assert "head 7 does not exist" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_negative_heads_layer_counts_from_the_end(tiny_folder, tmp_path):
    out = tmp_path / "o"
    argv = ["trace", "--text", "abcdef", "--model", str(tiny_folder), "--out", str(out)]
    assert main([*argv, "--heads=-1:3"]) == 0  # argparse: a leading - needs "="
    assert (out / "heatmaps.png").stat().st_size > 0


@pytest.mark.parametrize("dash", [["-"], ["--file", "-"]])
def test_trace_reads_standard_input(tiny_folder, tmp_path, monkeypatch, dash):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("read from stdin"))
    out = tmp_path / "o"
    argv = ["trace", *dash, "--model", str(tiny_folder), "--out", str(out), "--no-figures"]
    assert main(argv) == 0
    ids = cw.load_model(str(tiny_folder)).tokenizer("read from stdin")["input_ids"]
    assert cw.Trace.load(out).input_ids.tolist() == ids


def test_empty_text_exits_2_before_loading(tmp_path, capsys, no_loading):
    assert main(["trace", "--text", "  \n", "--out", str(tmp_path / "o")]) == 2
    assert "the text is empty" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["trace", "notes.txt"], "pass a text file as --file notes.txt"),
        (["attribute", "notes.txt"], "pass a text file as --file notes.txt"),
        (["trace", "--file", "{folder}"], "is a folder, not a text file"),
    ],
)
def test_a_stray_word_or_a_folder_names_the_fix(tmp_path, capsys, no_loading, argv, message):
    argv = [a.format(folder=tmp_path) for a in argv]
    assert main([*argv, "--out", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["report", "--text", "abc", "--window", "5:2"], "is an empty window"),
        (["report", "--text", "abc", "--view", "full", "--window", "0:2"], "drop --window"),
        (["report", "--trace", "{folder}", "--model", "smollm2"], "drop --model"),
        (["report", "--trace", "{folder}", "--truncate", "--device", "cpu"], "drop --device, --tr"),
        (["report", "--text", "abc", "--max-tokens", "0"], "--max-tokens must be at least 1"),
        (["trace", "--text", "abc", "--no-maps", "--heads", "0:0"], "drop --heads"),
        (["trace", "--text", "abc", "--no-figures", "--heads", "0:0"], "drop --heads"),
        (["trace", "--text", "abc", "--max-tokens", "0"], "--max-tokens must be at least 1"),
    ],
)
def test_options_that_would_be_ignored_are_refused(tmp_path, capsys, no_loading, argv, message):
    argv = [a.format(folder=tmp_path) for a in argv]
    out = tmp_path / ("r.html" if argv[0] == "report" else "o")
    try:
        code = main([*argv, "--out", str(out)])
    except SystemExit as stop:  # a value argparse's type refuses
        code = stop.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_sizes_may_be_given_as_text_in_the_api():
    """As on the command line: "8G", "32M" (or bytes); a bad size names the option."""
    opts = cw.TraceOptions(memory_limit="1.5G", block_bytes="32M")
    assert (opts.memory_limit, opts.block_bytes) == (1_500_000_000, 32_000_000)
    with pytest.raises(ValueError, match="memory_limit: expected a size like 8G"):
        cw.TraceOptions(memory_limit="lots")
    with pytest.raises(ValueError, match="block_bytes: the size must be a positive"):
        cw.TraceOptions(block_bytes=0)
    with pytest.raises(ValueError, match="memory_limit: the size must be a positive, finite"):
        cw.TraceOptions(memory_limit=float("inf"))
    assert cw.TraceOptions(memory_limit="8GiB").memory_limit == 8 * 2**30
    from contribution_weights.fields import as_bytes

    sizes = {"100": 100, "100B": 100, "2k": 2000, "2KiB": 2048, "512M": 512 * 10**6, 7.9: 7}
    assert {v: as_bytes(v) for v in sizes} == sizes


def test_a_measure_left_out_of_all_says_how_to_trace_it(tiny_folder):
    trace = cw.trace(cw.load_model(str(tiny_folder)), "abc abc", layers=[0])
    with pytest.raises(KeyError, match=r"'all' leaves out distance, ihc, projection: name"):
        trace["ihc"]
    only = cw.trace(cw.load_model(str(tiny_folder)), "abc abc", layers=[0], measures="attention")
    with pytest.raises(KeyError) as err:
        only["vw"]
    assert "was not traced" in str(err.value)
    assert "leaves out" not in str(err.value)  # vw is in 'all': nothing to add
    with pytest.raises(KeyError, match=r"--measures \.\.\.,ihc"):
        trace.token_scores("ihc")
    with pytest.raises(KeyError, match=r"no measure is called 'atention'.*'attention'\?"):
        trace["atention"]


def test_trace_with_the_tiled_kernels(tiny_folder, tmp_path):
    """`cw trace --no-maps --kernels triton` (here in Triton's interpreter) writes the
    reductions the plain path writes."""
    base = ["trace", "--text", "abcdefgh", "--model", str(tiny_folder), "--no-maps"]
    base += ["--no-figures", "--measures", "contribution,vw"]
    for kernels in ("torch", "triton"):
        assert main([*base, "--kernels", kernels, "--out", str(tmp_path / kernels)]) == 0
    plain, tiled = (cw.Trace.load(tmp_path / k) for k in ("torch", "triton"))
    for name in ("contribution", "vw"):
        torch.testing.assert_close(
            tiled.reductions[name].token_sums, plain.reductions[name].token_sums,
            rtol=1e-4, atol=1e-5,
        )  # fmt: skip
