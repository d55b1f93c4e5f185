"""``cw trace`` and ``cw measures`` end to end, on a tiny model saved to a folder."""

from __future__ import annotations

import json

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


def test_missing_model_and_empty_text(tmp_path, capsys):
    assert main(["trace", "--text", "hi", "--model", str(tmp_path / "nope"), "--out", "x"]) == 2
    assert "not found" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    assert main(["trace", "--file", str(empty), "--model", str(tmp_path), "--out", "x"]) == 2
    assert "config.json" in capsys.readouterr().err


def test_measures_lists_registry(capsys):
    assert main(["measures"]) == 0
    printed = capsys.readouterr().out
    for name in cw.measure_names():
        assert name in printed


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
