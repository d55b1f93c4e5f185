"""The data the HTML report embeds round-trips within the rounding the page states.

Brute-force references: the per-row bound max|row|/(2·levels) and float16's half-ulp are
recomputed here with plain loops in float64, independent of ``report_data.error_bound``.
"""

from __future__ import annotations

import argparse
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import tiny_model

import contribution_weights as cw
from contribution_weights.cli import main
from contribution_weights.fields import int_ranges
from contribution_weights.presentation import report_data
from contribution_weights.presentation.report import (
    ReportSizeWarning,
    build_report,
    notebook_html,
    read_report,
    write_report,
)

TEXT = "The cat sat on the mat.\nIt purred."


@pytest.fixture(scope="module")
def tiny_trace() -> cw.Trace:
    return cw.trace(tiny_model("llama"), TEXT)


def _row_bound_reference(blocks: np.ndarray, levels: int) -> np.ndarray:
    k, t, _ = blocks.shape
    out = np.zeros_like(blocks, dtype=np.float64)
    for b in range(k):
        for i in range(t):
            peak = max(abs(float(blocks[b, i, j])) for j in range(i + 1))
            out[b, i, : i + 1] = peak / levels / 2
    return out


def _float16_bound_reference(blocks: np.ndarray) -> np.ndarray:
    a = np.abs(blocks.astype(np.float64))
    out = np.empty_like(a)
    for idx, v in np.ndenumerate(a):
        if v < 2.0**-14:  # subnormal range: spacing 2^-24
            out[idx] = 2.0**-25
        else:
            out[idx] = 2.0 ** (np.floor(np.log2(v)) - 11)  # half a unit in the last place
    return out


def _random_blocks(seed: int, signed: bool, k: int = 3, t: int = 9) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.exponential(size=(k, t, t)) * 10.0 ** rng.uniform(-4, 1, size=(k, t, 1))
    if signed:
        x *= rng.choice([-1.0, 1.0], size=x.shape)
    x[0, 3] = 0.0  # an all-zero row
    x[1, 5, 2] = 0.0
    return np.triu(np.full((t, t), 7.0), 1) + np.tril(x)  # junk above the diagonal


@pytest.mark.parametrize("signed", [False, True])
def test_uint8_chunk_round_trip_within_half_a_row_step(signed):
    blocks = _random_blocks(0, signed)
    k, t, _ = blocks.shape
    data = report_data.encode_chunk(blocks, "uint8", signed)
    back = report_data.decode_chunk(data, "uint8", signed, k, t)
    lower = np.tril(np.ones((t, t), dtype=bool))
    ref = _row_bound_reference(blocks, 127 if signed else 255)
    err = np.abs(back - blocks)[:, lower]
    assert (err <= ref[:, lower] * (1 + 1e-6)).all()
    assert (back[:, ~lower] == 0).all()  # only the lower triangle is stored
    assert (back[0, 3] == 0).all() and back[1, 5, 2] == 0  # zeros stay exact
    # the row maximum is reproduced to float32 rounding, and the bound is not vacuous
    peaks = np.abs(np.tril(blocks)).max(-1)
    assert np.allclose(np.abs(np.tril(back)).max(-1), peaks, rtol=1e-6)
    assert err.max() > ref[:, lower].max() * 1e-3


def test_uint8_refuses_signed_data_as_unsigned_only_through_clipping():
    blocks = np.tril(np.ones((1, 4, 4))) * -1.0
    back = report_data.decode_chunk(
        report_data.encode_chunk(blocks, "uint8", False), "uint8", False, 1, 4
    )
    assert (back == 0).all()  # why the report stores a measure signed when any value is < 0


def test_float16_chunk_round_trip_within_half_an_ulp():
    blocks = _random_blocks(1, True)
    k, t, _ = blocks.shape
    back = report_data.decode_chunk(
        report_data.encode_chunk(blocks, "float16", True), "float16", True, k, t
    )
    lower = np.tril(np.ones((t, t), dtype=bool))
    ref = _float16_bound_reference(blocks)
    assert (np.abs(back - blocks)[:, lower] <= ref[:, lower]).all()
    assert (report_data.error_bound(blocks, "float16", True)[:, lower] >= ref[:, lower]).all()


def test_float16_refuses_values_it_cannot_hold():
    with pytest.raises(ValueError, match="precision='uint8'"):
        report_data.encode_chunk(np.full((1, 2, 2), 1e5), "float16", False)
    with pytest.raises(ValueError, match="NaN"):
        report_data.encode_chunk(np.full((1, 2, 2), np.nan), "uint8", False)


@pytest.mark.parametrize("precision", ["uint8", "float16"])
def test_report_embeds_every_head_layer_sum_and_mean(tmp_path, tiny_trace, precision):
    info = write_report(tiny_trace, tmp_path / "r.html", precision=precision, progress=False)
    embedded = read_report(info.path)
    meta = embedded.meta
    assert meta["tokens"] == tiny_trace.tokens
    assert meta["layers"] == tiny_trace.layers == info.layers
    assert info.size_bytes == (tmp_path / "r.html").stat().st_size
    t = tiny_trace.num_tokens
    lower = np.tril(np.ones((t, t), dtype=bool))
    for name in info.measures:
        full = tiny_trace[name].double().numpy()  # (L, H, T, T)
        signed = meta["measures"][name]["signed"]
        assert signed == bool((full < 0).any() or cw.get_measure(name).signed)
        expected = {str(layer): full[i] for i, layer in enumerate(tiny_trace.layers)}
        expected["mean"] = full.mean(0)
        for layer, heads in expected.items():
            want = np.concatenate([heads, heads.sum(0, keepdims=True)])
            got = embedded.values[(name, layer)]
            bound = (
                _row_bound_reference(want, 127 if signed else 255) * (1 + 1e-6) + 1e-12
                if precision == "uint8"
                else _float16_bound_reference(want) + 1e-12
            )
            assert (np.abs(got - want)[:, lower] <= bound[:, lower]).all(), (name, layer)
    assert "8 bits" in meta["rounding"] if precision == "uint8" else "float16" in meta["rounding"]


def test_summary_and_first_token_chart_are_exact(tiny_trace):
    page, _ = build_report(tiny_trace, progress=False)
    meta = read_report(page).meta
    summary = tiny_trace.summary()
    for row in meta["summary"]["rows"]:
        for col, value in row.items():
            if col != "measure":
                assert value == pytest.approx(summary.loc[row["measure"], col], rel=1e-12)
    by_layer = tiny_trace.first_token_weight_by_layer()
    for name, series in meta["first_token_weight"]["series"].items():
        assert series == pytest.approx(by_layer[name].tolist(), rel=1e-12)


def test_page_is_self_contained_and_escapes_tokens(tiny_trace):
    hostile = cw.Trace(**{**tiny_trace.__dict__, "tokens": list(tiny_trace.tokens)})
    hostile.tokens[1] = "</script><script>alert(1)</script>"
    hostile.tokens[2] = "a\u2028b"
    page, _ = build_report(hostile, progress=False)
    assert read_report(page).meta["tokens"] == hostile.tokens
    assert page.count("</script>") == page.count("<script")  # no early close
    assert not re.search(r'(src|href)\s*=\s*["\']?(https?:)?//', page)
    assert not re.search(r"@import|url\(\s*['\"]?https?:", page)
    assert "Content-Security-Policy" in page


def test_over_the_limit_keeps_evenly_spaced_layers_and_warns(tmp_path):
    model = tiny_model("gemma3_text")  # 3 layers
    trace = cw.trace(model, TEXT * 2, measures="attention,contribution,vw")
    all_three = build_report(trace, max_bytes=None, progress=False)[1].size_bytes
    two = build_report(trace, layers=[0, 2], max_bytes=None, progress=False)[1].size_bytes
    limit = two + (all_three - two) // 2  # room for two of the three layers and the warning
    with pytest.warns(ReportSizeWarning, match="left out 1"):
        info = write_report(trace, tmp_path / "r.html", max_bytes=limit, progress=False)
    assert info.layers == [0, 2] and info.dropped_layers == [1]
    assert info.size_bytes <= limit
    embedded = read_report(info.path)
    assert embedded.meta["warnings"] and "left out 1" in embedded.meta["warnings"][0]
    assert {layer for _, layer in embedded.values} == {"0", "2", "mean"}
    # the mean still covers all three traced layers
    mean = embedded.values[("attention", "mean")][:-1]
    want = trace["attention"].double().numpy().mean(0)
    assert np.allclose(np.tril(mean), np.tril(want), atol=1 / 510 + 1e-6)
    with pytest.raises(ValueError, match="even one layer"):
        write_report(trace, tmp_path / "s.html", max_bytes=20_000, progress=False)


def test_layer_ranges_in_the_warning():
    assert int_ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert int_ranges([3]) == "3" and int_ranges([]) == ""


def test_choice_of_measures_and_layers(tiny_trace):
    _, info = build_report(tiny_trace, measures="attention,vw", layers=[1], progress=False)
    assert info.measures == ["attention", "vw"] and info.layers == [1]
    with pytest.raises(ValueError, match="not in this trace"):
        build_report(tiny_trace, measures=["nonsense"], progress=False)
    with pytest.raises(ValueError, match="traced layers"):
        build_report(tiny_trace, layers=[7], progress=False)
    with pytest.raises(ValueError, match="precision"):
        build_report(tiny_trace, precision="int4", progress=False)


def test_write_report_and_notebook_view(tmp_path, tiny_trace):
    path = cw.write_report(tiny_trace, tmp_path / "sub" / "t.html", progress=False).path
    assert Path(path).is_file() and read_report(path).meta["compact"] is False
    # in IPython the package registers the display of a Trace (by type name) on import
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        cw._show_traces_in_notebooks()
        shown = shell.display_formatter.format(tiny_trace)[0]["text/html"]
    finally:
        InteractiveShell.clear_instance()
    assert shown.startswith("<iframe") and 'sandbox="allow-scripts"' in shown
    inner = re.search(r'srcdoc="(.*)"', shown, re.S)
    assert inner is not None
    import html

    assert read_report(html.unescape(inner.group(1))).meta["compact"] is True
    assert shown == notebook_html(tiny_trace)


def test_cli_report_from_a_saved_trace(tmp_path, tiny_trace, capsys):
    folder = tiny_trace.save(tmp_path / "trace")
    out = tmp_path / "report.html"
    assert main(["report", "--trace", str(folder), "--out", str(out), "--layers", "-1"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert read_report(out).meta["layers"] == [tiny_trace.layers[-1]]
    assert main(["report", "--trace", str(folder), "--out", str(out), "--max-bytes", "1k"]) == 2
    assert "max_bytes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["report", "--trace", str(folder), "--out", str(out), "--max-bytes", "lots"])
    assert main(["report", "--trace", str(tmp_path / "nope"), "--out", str(out)]) == 2
    assert "not a folder" in capsys.readouterr().err


def test_report_sizes_read_like_every_other_size():
    """--max-bytes takes sizes as --memory-limit does: M decimal, MiB binary, 0 for none."""
    from contribution_weights.cli.report_cmd import parse_size

    assert parse_size("20M") == parse_size("20MB") == 20_000_000
    assert parse_size("20MiB") == 20 * 2**20
    assert parse_size("1.5k") == 1500
    assert parse_size("0") is None and parse_size("none") is None
    with pytest.raises(argparse.ArgumentTypeError, match="8GiB"):
        parse_size("20 furlongs")


def test_tensors_are_not_modified(tiny_trace):
    before = {k: tiny_trace[k].tensor() for k in tiny_trace.measures}
    build_report(tiny_trace, progress=False)
    assert all(torch.equal(before[k], tiny_trace[k].tensor()) for k in before)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_report(tiny_trace, progress=False)  # under the limit: no warning


# ---- lazy traces, progress, what the page says it rounds ----------------------------------
class _OnlyPerHead:
    """A stand-in for a lazy on-disk map: indexing must name a layer and a head."""

    def __init__(self, values: torch.Tensor) -> None:
        self.values = values
        self.reads = 0

    def __getitem__(self, key):
        assert isinstance(key, tuple) and len(key) >= 2, f"whole-tensor read: {key!r}"
        assert all(isinstance(k, int) for k in key[:2]), f"not per (layer, head): {key!r}"
        self.reads += 1
        return self.values[key]


def test_report_reads_maps_per_layer_and_head(tiny_trace, monkeypatch):
    lazy = {name: _OnlyPerHead(tiny_trace[name]) for name in ("attention", "contribution")}
    monkeypatch.setattr(
        type(tiny_trace), "__getitem__", lambda self, name: lazy.get(name) or self.measures[name]
    )
    monkeypatch.setattr(
        "contribution_weights.presentation.report._summary_tables",
        lambda trace: ({"columns": [], "rows": []}, {"layers": trace.layers, "series": {}}),
    )
    page, _ = build_report(tiny_trace, measures=["attention", "contribution"], progress=False)
    monkeypatch.undo()
    got = read_report(page)
    for name in ("attention", "contribution"):
        assert lazy[name].reads > 0
        want = tiny_trace[name].double().numpy()
        last = str(tiny_trace.layers[-1])
        np.testing.assert_allclose(got.values[(name, last)][:-1], want[-1], atol=2e-2)
        np.testing.assert_allclose(got.values[(name, "mean")][:-1], want.mean(0), atol=2e-2)


def test_page_says_only_its_values_are_rounded(tiny_trace):
    page, _ = build_report(tiny_trace, progress=False)
    meta = read_report(page).meta
    # not "the model ran unquantised": the embedded models are dequantised 4-bit GGUFs
    assert "trace itself is not rounded" in meta["rounding"]
    assert "unquantised" not in meta["rounding"]
    js = Path(cw.__file__).parent / "presentation" / "assets" / "report.js"
    text = js.read_text("utf-8")
    assert "8-bit weights" not in text and "the trace itself is not rounded" in text
    assert meta["defaults"] == {"contrast": "linear", "heat_rows": "block"}  # 12 tokens


def test_status_prints_only_for_slow_steps(capsys):
    import time

    from contribution_weights.progress import status

    with status("quick step", delay=0.5):
        pass
    assert capsys.readouterr().err == ""
    with status("slow step", delay=0.05):
        time.sleep(0.3)
    err = capsys.readouterr().err
    assert "slow step…" in err and "slow step: done in" in err


def test_cli_report_traces_with_a_progress_bar(tmp_path, monkeypatch):
    import contribution_weights.tracing as tracing

    calls = []
    real = tracing.trace

    def spy(*args, **kwargs):
        calls.append(kwargs.get("progress"))
        return real(*args, **kwargs)

    monkeypatch.setattr(tracing, "trace", spy)
    monkeypatch.setattr(
        "contribution_weights.loading.load_model", lambda *a, **k: tiny_model("llama")
    )
    assert main(["report", "--text", TEXT, "--out", str(tmp_path / "r.html")]) == 0
    assert calls == [True]


def test_a_trace_without_maps_gets_the_long_view_and_the_full_view_says_why_not(tmp_path, capsys):
    """Not "the trace has none of the measures" while listing them as present."""
    from contribution_weights.presentation.long_report import read_long_report

    reduced = cw.trace(tiny_model("llama"), TEXT, maps=False)
    for write in (
        lambda: write_report(reduced, tmp_path / "a.html", progress=False, view="full"),
        lambda: cw.write_report(reduced, tmp_path / "b.html", view="full"),
    ):
        with pytest.raises(ValueError, match="holds no maps") as err:
            write()
        assert "maps=False" in str(err.value) and 'view="long"' in str(err.value)
        assert "--no-maps" not in str(err.value)  # the Python spelling in the API
    info = write_report(reduced, tmp_path / "auto.html", progress=False)
    meta, chunks = read_long_report(info.path)
    assert info.view == "long" and meta["window"] is None
    assert all(c.window.shape[0] == 0 for c in chunks.values())
    assert "holds no maps" in info.warnings[0]
    folder = reduced.save(tmp_path / "reduced")
    out = tmp_path / "r.html"
    assert main(["report", "--trace", str(folder), "--out", str(out), "--view", "full"]) == 2
    message = " ".join(capsys.readouterr().err.split())
    assert "holds no maps" in message and "cw trace --no-maps" in message
    assert "--view long" in message
    assert "cw trace --file TEXT --model tiny-llama --out DIR" in message
    assert "maps=False" not in message and "has none of" not in message
    assert not out.exists()
    assert main(["report", "--trace", str(folder), "--out", str(out)]) == 0
    assert "long view" in capsys.readouterr().out and out.exists()


def test_cli_report_traces_distance_only_when_named(tmp_path, monkeypatch):
    import contribution_weights.tracing as tracing

    traced: list[cw.Trace] = []
    real = tracing.trace

    def spy(*args, **kwargs):
        traced.append(real(*args, **kwargs))
        return traced[-1]

    monkeypatch.setattr(tracing, "trace", spy)
    monkeypatch.setattr(
        "contribution_weights.loading.load_model", lambda *a, **k: tiny_model("llama")
    )
    out = tmp_path / "r.html"
    assert main(["report", "--text", TEXT, "--out", str(out)]) == 0
    assert traced[-1].measures == ["attention", "contribution", "intra", "vw", "vw_on"]
    assert read_report(out).meta["measure_order"] == traced[-1].measures
    named = ["--measures", "attention,distance"]
    assert main(["report", "--text", TEXT, *named, "--out", str(out)]) == 0
    assert traced[-1].measures == ["attention", "distance"]
    assert read_report(out).meta["measure_order"] == ["attention", "distance"]


@pytest.mark.parametrize("t", [50, 70_000])  # 2-byte and 4-byte source distances
def test_long_view_chunks_round_trip_within_their_rounding(t):
    from contribution_weights.presentation.long_report import (
        LongChunk,
        decode_long_chunk,
        encode_long_chunk,
        key_bins,
    )

    rng = np.random.default_rng(0)
    heads, k, window = 2, 3, 4
    queries = np.arange(t)[None, :, None]
    keys = np.minimum(queries, rng.integers(0, t, size=(heads, t, k)))
    keys[:, 0, 1:] = -1  # query 0 sees one key: empty slots
    weights = rng.uniform(-1, 1, size=(heads, t, k))
    weights[..., 0] = 1.0
    chunk = LongChunk(
        scores=rng.normal(size=(heads + 1, t)),
        first=rng.normal(size=(heads + 1, t)),
        window=rng.normal(size=(window, len(key_bins(t)))),
        source_keys=keys,
        source_weights=weights,
    )
    back = decode_long_chunk(encode_long_chunk(chunk, True), True, heads, t, window, k)
    np.testing.assert_array_equal(back.source_keys, keys)
    assert np.abs(back.source_weights - weights).max() <= 0.5 / 127 + 1e-12
    for name in ("scores", "first", "window"):
        want, got = getattr(chunk, name), getattr(back, name)
        step = np.abs(want).max(-1, keepdims=True) / 127
        assert (np.abs(got - want) <= step / 2 * (1 + 1e-6)).all(), name
