"""A researcher's question from the command line ("which tokens contribute most to the
last token at layer L, and is token 0 a sink?"), and no earlier trace lost: ``cw show``,
the sink verdict, ``--overwrite``, the trailing newline of ``--file``, binary input, and
``Attribution.top(exclude_first=...)``."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tiny_models import save_tiny, tiny_model

import contribution_weights as cw
from contribution_weights.cli import main
from contribution_weights.tracing.folder import TraceExistsError
from contribution_weights.tracing.query import top_tokens

TEXT = "the cat sat on the mat"


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def lm():
    return tiny_model("llama", dtype=torch.float64)


def _trace_argv(model_folder, out, *extra):
    return ["trace", "--text", TEXT, "--model", str(model_folder), "--out", str(out),
            "--no-figures", *extra]  # fmt: skip


# ---- no earlier trace lost ----------------------------------------------------------------
def test_a_second_trace_into_a_folder_is_refused_naming_the_first(model_folder, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_trace_argv(model_folder, out, "--layers", "1")) == 0
    before = (out / "meta.json").read_bytes()
    capsys.readouterr()
    argv = ["trace", "--text", "another text entirely", "--model", str(model_folder),
            "--out", str(out), "--no-figures"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{out} already holds a trace" in err
    assert f"{len(TEXT)} tokens" in err and "layers 1 " in err and "--overwrite" in err
    assert json.loads(before)["created"] in err  # its date
    assert (out / "meta.json").read_bytes() == before  # nothing lost
    assert main([*argv, "--overwrite"]) == 0
    assert cw.Trace.load(out).num_tokens == len("another text entirely")


def test_the_python_api_refuses_too_unless_overwrite(lm, tmp_path):
    cw.trace(lm, TEXT, out=tmp_path, measures="attention")
    with pytest.raises(TraceExistsError, match="overwrite=True"):
        cw.trace(lm, "other", out=tmp_path, measures="attention")
    memory = cw.trace(lm, "other", measures="attention")
    with pytest.raises(TraceExistsError, match=f"{len(TEXT)} tokens"):
        memory.save(tmp_path)
    assert cw.Trace.load(tmp_path).num_tokens == len(TEXT)
    memory.save(tmp_path, overwrite=True)
    assert cw.Trace.load(tmp_path).num_tokens == len("other")
    cw.trace(lm, TEXT, out=tmp_path, measures="attention", overwrite=True)
    assert cw.Trace.load(tmp_path).num_tokens == len(TEXT)


def test_a_folder_of_other_files_is_no_trace_to_protect(lm, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    cw.trace(lm, TEXT, out=tmp_path, measures="attention")
    assert (tmp_path / "notes.txt").read_text() == "mine"


# ---- the text as given ----------------------------------------------------------------
def test_one_trailing_newline_of_a_file_is_dropped_unless_kept(model_folder, tmp_path, capsys):
    text = tmp_path / "para.txt"
    text.write_text(TEXT + "\n")
    out = tmp_path / "run"
    argv = ["trace", "--file", str(text), "--model", str(model_folder), "--out", str(out),
            "--no-figures", "--measures", "attention"]  # fmt: skip
    assert main(argv) == 0
    assert cw.Trace.load(out).num_tokens == len(TEXT)  # the last token is the text's own
    assert main([*argv, "--overwrite", "--keep-trailing-newline"]) == 0
    assert cw.Trace.load(out).num_tokens == len(TEXT) + 1
    text.write_bytes((TEXT + "\r\n\r\n").encode())  # one newline only (read as \n)
    assert main([*argv, "--overwrite"]) == 0
    assert cw.Trace.load(out).num_tokens == len(TEXT) + 1
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["trace", "--help"])
    assert "--keep-trailing-newline" in capsys.readouterr().out


def test_a_binary_file_is_named_as_not_utf8_text(tmp_path, capsys):
    blob = tmp_path / "weights.bin"
    blob.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    argv = ["trace", "--file", str(blob), "--model", str(tmp_path), "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert str(blob) in err and "not UTF-8 text" in err and "codec" not in err


# ---- cw show ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def traced(model_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("show") / "trace"
    assert main(_trace_argv(model_folder, out)) == 0
    return out


def test_show_ranks_a_querys_tokens_by_their_share_summed_over_heads(traced, capsys):
    trace = cw.Trace.load(traced)
    table = trace.top_tokens(1, -1, k=5)
    q = trace.num_tokens - 1
    contribution = trace["contribution"][1][:, q, :].double().sum(0)  # ĉ sums to 1 as it is
    attention = trace["attention"][1][:, q, :].double().sum(0) / trace.num_heads  # α / H
    expected = torch.argsort(contribution.abs(), descending=True, stable=True)[:5]
    assert table["position"].tolist() == expected.tolist()
    assert torch.allclose(torch.tensor(table["contribution"].tolist()).double(),
                          contribution[expected], atol=1e-6)  # fmt: skip
    assert torch.allclose(torch.tensor(table["attention"].tolist()).double(),
                          attention[expected], atol=1e-6)  # fmt: skip
    assert table.attrs["exact"] and table.attrs["query"] == q
    assert math.isclose(table.attrs["first"]["attention"], float(attention[0]), abs_tol=1e-6)

    assert main(["show", str(traced), "--layer", "1", "--top", "5", "--heads"]) == 0
    out = capsys.readouterr().out
    assert f"{len(TEXT)} tokens" in out  # which trace it is
    assert f"layer 1, query {q}" in out
    lines = out.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("rank"))
    assert header.split()[3:] == ["contribution", "attention", "h0", "h1", "h2", "h3"]
    first_row = lines[lines.index(header) + 1].split()
    assert int(first_row[1]) == int(expected[0])
    heads = [float(x) for x in first_row[-4:]]
    assert math.isclose(sum(heads), float(first_row[-6]), abs_tol=2e-4)  # they add up
    assert "layer 1 is " in out and "sink layer" in out


def test_show_by_attention_and_without_token_0(traced):
    trace = cw.Trace.load(traced)
    table = trace.top_tokens(-1, 3, k=3, measure="attention", exclude_first=True)
    assert table.attrs["layer"] == 1 and 0 not in table["position"].tolist()
    assert list(table.columns) == ["position", "token", "attention", "contribution"]
    assert max(table["position"]) <= 3  # a query sees no later key


def test_a_trace_without_maps_answers_from_its_top_keys(lm, tmp_path):
    with_maps = cw.trace(lm, TEXT, measures="attention,contribution")
    few = cw.trace(lm, TEXT, out=tmp_path / "few", maps=False, top_k=4,
                   measures="attention,contribution")  # fmt: skip
    every = cw.trace(lm, TEXT, out=tmp_path / "all", maps=False, top_k=len(TEXT),
                     measures="attention,contribution")  # fmt: skip
    exact = top_tokens(with_maps, 1, -1, k=6)
    full = top_tokens(every, 1, -1, k=6)
    assert full.attrs["exact"] and full["position"].tolist() == exact["position"].tolist()
    assert torch.allclose(torch.tensor(full["contribution"].tolist()),
                          torch.tensor(exact["contribution"].tolist()), atol=1e-6)  # fmt: skip
    approx = top_tokens(few, 1, -1, k=6)
    assert not approx.attrs["exact"]
    # each head adds its exact share where the key is among its top 4, and 0 elsewhere
    q, h = len(TEXT) - 1, lm.num_heads
    shares = with_maps["attention"][1][:, q, :].double() / h
    kept = few.kept_reductions("attention").top_keys[1, :, q].long()  # (H, 4)
    for pos, share in zip(approx["position"], approx["attention"], strict=True):
        expected = sum(float(shares[k, pos]) for k in range(h) if (kept[k] == pos).any())
        assert share == pytest.approx(expected, abs=1e-9), pos


def test_show_errors_name_the_fix(traced, tmp_path, capsys):
    assert main(["show", str(traced), "--layer", "7"]) == 2
    assert "traced layers: [0, 1]" in capsys.readouterr().err
    assert main(["show", str(traced), "--layer", "1", "--query", "500"]) == 2
    assert "out of range" in capsys.readouterr().err
    assert main(["show", str(traced), "--layer", "1", "--measure", "cosine"]) == 2
    assert "not a weight measure" in capsys.readouterr().err
    assert main(["show", str(traced), "--layer", "1", "--measure", "distance"]) == 2
    assert "was not traced" in capsys.readouterr().err
    assert main(["show", str(tmp_path / "nothing")]) == 2
    assert "not a folder" in capsys.readouterr().err


# ---- the sink verdict -------------------------------------------------------------------
def test_the_sink_verdict_per_layer_in_trace_and_show(model_folder, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_trace_argv(model_folder, out)) == 0
    printed = capsys.readouterr().out
    trace = cw.Trace.load(out)
    sinks = trace.sinks()
    attention = trace.first_token_weight("attention")
    assert sinks.index.tolist() == [0, 1]
    assert sinks["attention_to_first"].tolist() == pytest.approx(attention.tolist())
    assert sinks["contribution_of_first"].tolist() == pytest.approx(
        trace.first_token_weight("contribution").tolist()
    )
    assert sinks["sink"].tolist() == [a > 0.5 for a in attention.tolist()]
    low = float(attention.min()) - 1e-3  # a threshold below every layer: all are sinks
    assert trace.sinks(low)["sink"].all() and not trace.sinks(1.0)["sink"].any()
    assert "attention sinks:" in printed and "contribution of 0" in printed
    for layer, row in sinks.iterrows():
        line = f"{layer:>5} {row['attention_to_first']:>15.3f}"
        assert any(x.startswith(line) for x in printed.splitlines()), line
    assert main(["show", str(out), "--threshold", f"{low}"]) == 0
    assert "2 of 2 layers" in capsys.readouterr().out


def test_no_sink_verdict_without_attention(lm):
    trace = cw.trace(lm, TEXT, measures="contribution")
    with pytest.raises(ValueError, match="needs the attention measure"):
        trace.sinks()


# ---- Attribution.top --------------------------------------------------------------------
def test_attribution_top_leaves_token_0_out_by_default(lm):
    a = cw.attribute(lm, torch.arange(3, 15), target=8, methods="flow")
    scores = a["flow"][0][:9]
    with_first = a.top(9, exclude_first=False)
    assert sorted(p for p, _, _ in with_first) == list(range(9))
    by_size = torch.argsort(scores.abs(), descending=True, stable=True).tolist()
    assert [p for p, _, _ in with_first] == by_size
    assert [p for p, _, _ in a.top(9)] == [p for p in by_size if p != 0]
    assert "token 0 (the attention sink) aside" in a.summary()
