"""The HTML report in a real headless browser (Debian's chromium driven by chromedriver).

The page is opened from disk (file://). We hover and click tokens and compare the
weights the page shows (each token's ``data-w`` and colour) with the trace's tensors,
switch measure, layer and head, search a token, and check that the browser console
stayed free of errors. Screenshots go to test-artifacts/.

The browser is installed by .ci/install-browser.sh when missing; the tests skip, saying
why, only where that cannot be done (no apt, not root).
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from tiny_models import tiny_model
from webdriver_client import Browser, find_browser

import contribution_weights as cw
from contribution_weights.presentation.report import notebook_html, read_report, write_report

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "test-artifacts"
TEXT = "Paris is the capital of France.\nThe Seine runs through it."
POS, MID, MASKED = (178, 24, 43), (255, 255, 255), (236, 238, 242)


@pytest.fixture(scope="module")
def browser():
    found = find_browser()
    if found is None:
        script = REPO / ".ci" / "install-browser.sh"
        run = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=600)
        found = find_browser()
        if found is None:
            pytest.skip(
                "chromium/chromedriver are missing and .ci/install-browser.sh could not install "
                f"them here: {(run.stderr or run.stdout).strip()[-300:]}"
            )
    b = Browser(*found)
    try:
        yield b
    finally:
        b.close()


def _errors(b: Browser) -> list[str]:
    return [e["message"] for e in b.console() if e.get("level") in ("SEVERE", "ERROR")]


def _settled(b: Browser) -> None:
    b.wait("document.body.dataset.ready === '1' && document.body.dataset.pending === '0'")


def _shown_weights(b: Browser) -> dict[int, float]:
    pairs = b.js(
        "return Array.from(document.querySelectorAll('.tok'))"
        ".filter(e => e.dataset.w !== undefined)"
        ".map(e => [Number(e.dataset.i), Number(e.dataset.w)]);"
    )
    return {int(i): float(w) for i, w in pairs}


def _rgb(b: Browser, i: int) -> tuple[int, ...]:
    text = b.js(f"return document.querySelector('.tok[data-i=\"{i}\"]').style.backgroundColor;")
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def _close(rgb: tuple[int, ...], want: tuple[int, ...]) -> bool:
    return all(abs(a - b) <= 1 for a, b in zip(rgb, want, strict=True))


def _expected_row(trace: cw.Trace, measure: str, layer: str, head: str, query: int) -> np.ndarray:
    values = trace[measure].double().numpy()
    heads = values.mean(0) if layer == "mean" else values[trace.layer_position(int(layer))]
    block = heads.sum(0) if head == "sum" else heads[int(head)]
    return block[query, : query + 1]


def _check_row(b, trace, measure, layer, head, query, precision="uint8"):
    shown = _shown_weights(b)
    want = _expected_row(trace, measure, layer, head, query)
    assert sorted(shown) == list(range(query + 1))  # only keys ≤ query are coloured
    got = np.array([shown[j] for j in range(query + 1)])
    signed = bool((trace[measure] < 0).any() or cw.get_measure(measure).signed)
    step = np.abs(want).max() / (127 if signed else 255)
    assert np.abs(got - want).max() <= step / 2 * (1 + 1e-6) + 1e-12, (measure, layer, head)
    # colour: the largest |w| gets the full colour of its sign; zero weights stay white
    top = int(np.abs(want).argmax())
    assert _close(_rgb(b, top), POS if want[top] > 0 else (33, 102, 172))
    return got


def test_report_in_the_browser(tmp_path, browser):
    trace = cw.trace(tiny_model("qwen2"), TEXT)
    path = write_report(trace, tmp_path / "report.html", progress=False).path
    b = browser
    start = time.perf_counter()
    b.open(path)
    _settled(b)
    load_s = time.perf_counter() - start
    assert _errors(b) == []
    assert b.js("return document.querySelectorAll('.tok').length;") == trace.num_tokens
    assert b.js("return document.getElementById('cw-measure').value;") == "contribution"
    last = str(trace.layers[-1])

    # hover: the default view (contribution, last layer, sum over heads)
    q = 20
    b.hover(f'.tok[data-i="{q}"]')
    b.wait(f"document.querySelector('.tok[data-i=\"{q}\"]').classList.contains('query')")
    _check_row(b, trace, "contribution", last, "sum", q)
    assert "Query #20" in b.js("return document.getElementById('cw-query').textContent;")

    # click pins the query; switching the measure recolours from the new tensors
    q = 33
    b.click(f'.tok[data-i="{q}"]')
    b.select("#cw-measure", "attention")
    _settled(b)
    b.wait(f"document.body.dataset.rendered === 'attention|{last}|4|{q}'")
    got = _check_row(b, trace, "attention", last, "sum", q)
    assert got.sum() == pytest.approx(trace.num_heads, abs=0.05)  # Σ heads of softmaxes

    # another layer and one head, then the mean over layers
    b.select("#cw-layer", "0")
    b.select("#cw-head", "2")
    _settled(b)
    b.wait(f"document.body.dataset.rendered === 'attention|0|2|{q}'")
    _check_row(b, trace, "attention", "0", "2", q)
    b.select("#cw-measure", "vw")
    b.select("#cw-layer", "mean")
    _settled(b)
    b.wait(f"document.body.dataset.rendered === 'vw|mean|2|{q}'")
    _check_row(b, trace, "vw", "mean", "2", q)

    # heatmaps: masked cells grey, the strongest cell of the block fully coloured
    b.select("#cw-layer", last)
    b.select("#cw-head", "4")
    _settled(b)
    block = trace["attention"][trace.layer_position(int(last))].double().sum(0).numpy()
    i, j = np.unravel_index(np.tril(block).argmax(), block.shape)
    pixel = (
        "return Array.from(document.querySelector('#cw-hm-0 canvas').getContext('2d')"
        ".getImageData(arguments[0], arguments[1], 1, 1).data).slice(0, 3);"
    )
    assert _close(tuple(b.js(pixel, int(j), int(i))), POS)
    assert tuple(b.js(pixel, 5, 1)) == MASKED
    assert b.js("return document.querySelector('#cw-hm-1 select').value;") == "contribution"

    # search: "#7" finds token 7, Enter pins it
    b.type("#cw-search", "#7")
    assert b.js("return document.getElementById('cw-search-count').textContent;").startswith(
        "1 match"
    )
    b.type("#cw-search", "\ue007")  # Enter
    b.wait("document.querySelector('.tok[data-i=\"7\"]').classList.contains('pinned')")
    _settled(b)
    _check_row(b, trace, "vw", last, "sum", 7)

    # clicking a point of the first-token chart shows that layer
    b.click('#cw-chart circle.pt[data-layer="0"]')
    _settled(b)
    b.wait("document.body.dataset.rendered === 'vw|0|4|7'")
    assert b.js("return document.getElementById('cw-layer').value;") == "0"
    _check_row(b, trace, "vw", "0", "sum", 7)

    # the chart and the table are there
    assert b.js("return document.querySelectorAll('#cw-chart polyline').length;") == len(
        trace.weight_measures()
    )
    assert b.js("return document.querySelectorAll('#cw-summary tbody tr').length;") == len(
        trace.weight_measures()
    )
    assert _errors(b) == []
    b.screenshot(ARTIFACTS / "report-browser.png")
    assert load_s < 10


def test_notebook_view_runs_in_a_sandboxed_iframe(tmp_path, browser):
    trace = cw.trace(tiny_model("gemma2"), TEXT)
    page = tmp_path / "notebook.html"
    page.write_text("<!DOCTYPE html><html><body>" + notebook_html(trace) + "</body></html>")
    b = browser
    b.open(page)
    b.cmd("POST", "/frame", {"id": {"element-6066-11e4-a52e-4f735466cecf": b.find("iframe")}})
    _settled(b)
    assert b.js("return document.body.className;") == "compact"
    b.click('.tok[data-i="12"]')
    _settled(b)
    _check_row(b, trace, "contribution", str(trace.layers[-1]), "sum", 12)
    assert _errors(b) == []
    b.cmd("POST", "/frame/parent")
    b.screenshot(ARTIFACTS / "report-notebook.png")


@pytest.mark.slow
def test_smollm2_report_at_a_realistic_length(tmp_path, browser, smollm2, shared_data):
    import json

    doc = json.loads(
        (shared_data / "fineweb_edu" / "fineweb_edu_sample10BT_150docs.jsonl").open().readline()
    )
    trace = cw.trace(
        smollm2, doc["text"], measures="attention,contribution", max_tokens=256, truncate=True
    )
    info = write_report(trace, tmp_path / "smollm2.html", progress=False)
    assert info.layers == list(range(30)) and info.size_bytes < 100 * 2**20
    assert read_report(info.path).meta["num_tokens"] == 256
    b = browser
    start = time.perf_counter()
    b.open(info.path)
    _settled(b)
    load_s = time.perf_counter() - start
    # responsiveness: pin a late token, then switch layers, timed inside the page
    b.click('.tok[data-i="250"]')
    _check_row(b, trace, "contribution", "29", "sum", 250)
    timing = b.js(
        "const t0 = performance.now(); const s = document.getElementById('cw-layer');"
        "s.value = '12'; s.dispatchEvent(new Event('change'));"
        "return new Promise(r => { const f = () => document.body.dataset.rendered.startsWith("
        "'contribution|12|') ? r(performance.now() - t0) : setTimeout(f, 5); f(); });"
    )
    _check_row(b, trace, "contribution", "12", "sum", 250)
    assert _errors(b) == []
    b.screenshot(ARTIFACTS / "report-smollm2.png")
    print(
        f"SmolLM2 256 tokens: {info.size_bytes / 2**20:.1f} MiB, load {load_s:.2f} s, "
        f"layer switch {timing:.0f} ms"
    )
    assert load_s < 20 and timing < 3000


_VISIBLE = (
    "const c = document.querySelector(arguments[0] + ' canvas');"
    "const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
    "let shown = 0, cells = 0;"
    "for (let i = 0; i < c.height; i++) for (let j = 0; j <= i; j++) {"
    "  const o = 4 * (i * c.width + j); cells++;"
    "  if (Math.min(d[o], d[o + 1], d[o + 2]) < 245) shown++; }"  # visibly tinted
    "return shown / cells;"
)


@pytest.mark.slow
def test_a_300_token_report_shows_structure_by_default(tmp_path, browser, smollm2):
    """At 300 tokens the page opens with √ contrast and per-row heatmap scaling, and
    the heatmaps are visibly coloured without any hand-tuning."""
    from contribution_weights.presentation.report import LONG_TEXT_TOKENS

    prose = (REPO / "docs" / "method.md").read_text("utf-8")
    trace = cw.trace(
        smollm2, prose, measures="attention,contribution", max_tokens=300, truncate=True
    )
    assert trace.num_tokens == 300 >= LONG_TEXT_TOKENS
    info = write_report(trace, tmp_path / "long.html", progress=False)
    b = browser
    b.open(info.path)
    _settled(b)
    assert b.js("return document.getElementById('cw-contrast').value;") == "sqrt"
    assert b.js("return document.getElementById('cw-heat-rows').value;") == "row"
    subtitle = b.js("return document.getElementById('cw-subtitle').textContent;")
    assert "8-bit weights" not in subtitle and "trace itself is not rounded" in subtitle
    shown = [b.js(_VISIBLE, f"#cw-hm-{k}") for k in (0, 1)]
    b.click('.tok[data-i="280"]')
    _settled(b)
    b.screenshot(ARTIFACTS / "report-300-tokens.png")
    # the old defaults (linear, one scale per block) leave the heatmaps nearly blank
    b.select("#cw-contrast", "linear")
    b.select("#cw-heat-rows", "block")
    _settled(b)
    before = [b.js(_VISIBLE, f"#cw-hm-{k}") for k in (0, 1)]
    print(f"coloured lower-triangle cells: defaults {shown}, linear/block {before}")
    assert min(shown) > 0.15
    assert all(s > 3 * x for s, x in zip(shown, before, strict=True))
    assert _errors(b) == []


def test_short_reports_keep_linear_defaults():
    from contribution_weights.presentation.report import LONG_TEXT_TOKENS, view_defaults

    assert view_defaults(60) == {"contrast": "linear", "heat_rows": "block"}
    assert view_defaults(LONG_TEXT_TOKENS) == {"contrast": "sqrt", "heat_rows": "row"}


def test_the_long_view_in_the_browser(tmp_path, browser):
    """The long view (per-token heat over the text, a window of queries) shows the trace's
    reductions: token scores, each query's first-token weight, a query's top sources,
    and the window's rows, within the stated 8-bit rounding."""
    from contribution_weights.presentation.long_report import first_weights, key_bins

    trace = cw.trace(tiny_model("qwen2"), (TEXT + " ") * 2)
    t = trace.num_tokens
    info = write_report(trace, tmp_path / "long.html", view="long", window=(20, 60), progress=False)
    assert info.view == "long"
    b = browser
    b.open(info.path)
    _settled(b)
    assert _errors(b) == []
    assert b.js("return document.querySelectorAll('#cw-tokens .tok').length;") == t
    last = trace.layers[-1]
    pos = trace.layer_position(last)

    def check(want: np.ndarray, signed: bool) -> None:
        shown = _shown_weights(b)
        assert sorted(shown) == list(range(t))
        got = np.array([shown[j] for j in range(t)])
        step = np.abs(want).max() / (127 if signed else 255)
        assert np.abs(got - want).max() <= step / 2 * (1 + 1e-5) + 1e-12

    # default: contribution, last layer, sum over heads, token scores
    b.wait(f"document.body.dataset.rendered === 'contribution|{last}|{trace.num_heads}|scores|59'")
    check(trace.token_scores("contribution")[pos].double().sum(0).numpy(), signed=True)

    # each query's weight on token 0, one head, attention
    b.select("#cw-measure", "attention")
    b.select("#cw-head", "2")
    b.select("#cw-heat", "first")
    b.wait(f"document.body.dataset.rendered === 'attention|{last}|2|first|59'")
    check(first_weights(trace, "attention")[pos, 2].numpy(), signed=False)

    # click a token: its top sources in head 2 are coloured, nothing else
    b.select("#cw-heat", "sources")
    b.click('#cw-tokens .tok[data-i="45"]')
    b.wait(f"document.body.dataset.rendered === 'attention|{last}|2|sources|45'")
    values, keys = trace.top_k("attention", 3)
    want = {
        int(k): float(v)
        for k, v in zip(keys[pos, 2, 45], values[pos, 2, 45], strict=True)
        if k >= 0
    }
    shown = _shown_weights(b)
    assert sorted(shown) == sorted(want)
    top = max(want.values())
    for j, v in want.items():
        assert shown[j] == pytest.approx(v / top, abs=0.5 / 127 + 1e-9)

    # the window: 40 query rows over the key bins; the selected query's row is dark, and
    # the largest cell of another row has the full positive colour
    assert b.js(
        "const c = document.getElementById('cw-win-canvas'); return [c.width, c.height];"
    ) == [
        len(key_bins(t)),
        40,
    ]
    pixel = (
        "return Array.from(document.getElementById('cw-win-canvas').getContext('2d')"
        ".getImageData(arguments[0], arguments[1], 1, 1).data).slice(0, 3);"
    )
    assert tuple(b.js(pixel, 0, 45 - 20)) == (17, 24, 39)
    row = trace["attention"][pos, :, 30].double().sum(0).numpy()
    assert _close(tuple(b.js(pixel, int(row.argmax()), 30 - 20)), POS)
    # clicking a window row selects that query
    b.js(
        "const c = document.getElementById('cw-win-canvas'); const r = c.getBoundingClientRect();"
        "c.dispatchEvent(new MouseEvent('click', {clientX: r.left + 2, "
        "clientY: r.top + r.height * (10.5 / 40), bubbles: true}));"
    )
    b.wait(f"document.body.dataset.rendered === 'attention|{last}|2|sources|30'")
    assert b.js("return document.querySelectorAll('#cw-chart polyline').length;") == len(
        trace.weight_measures()
    )
    assert _errors(b) == []
    b.screenshot(ARTIFACTS / "report-long-view.png")
