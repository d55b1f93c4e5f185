"""The views of an attribution: the heat-strip and routes figures, and the self-contained
HTML page (in a real headless browser when one is there)."""

from __future__ import annotations

import html
import re
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import tiny_model

from contribution_weights.attribution.result import Attribution, Edge, Routes
from contribution_weights.attribution.run import attribute
from contribution_weights.attribution.targets import Target
from contribution_weights.presentation import figures
from contribution_weights.presentation.attribution_html import (
    read_attribution_html,
    write_attribution_html,
)
from contribution_weights.presentation.attribution_plots import (
    STRONGEST_LABELS,
    ZOOM_TOKENS,
    attribution_figure,
    routes_figure,
    strip_view,
)

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "test-artifacts"
METHODS = "flow,rollout,alti"
#: tokens that must survive the page as text: markup, entities, quotes, newlines, nothing
AWKWARD = ["<b>", "&amp;", '"q"', "it's", "\n", "a\nb", "</script>", "", " x", "\t<"]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def continued(model) -> Attribution:
    """Several targets (a continuation), three methods, routes; awkward token texts."""
    result = attribute(model, "abcdefghij", continuation="xyz", methods=METHODS, routes=True)
    tokens = AWKWARD + result.tokens[len(AWKWARD) :]
    return replace(result, tokens=tokens)


@pytest.fixture(scope="module")
def single(model) -> Attribution:
    """One target, one method, no routes."""
    return attribute(model, "hello world", methods="flow")


def _synthetic(t: int, targets: int = 1, routes: bool = True) -> Attribution:
    """A long attribution without a model: small noise and one strong token per method."""
    gen = torch.Generator().manual_seed(0)
    positions = list(range(t - targets, t))
    scores = {}
    for k, name in enumerate(("flow", "rollout")):
        s = (torch.rand(targets, t, generator=gen, dtype=torch.float64) - 0.4) * 1e-3
        s[:, 37 + 500 * k] = 1.0 - 2.0 * k  # one peak (negative for rollout)
        scores[name] = s
    edges = [Edge(layer, 37, t - 1, layer % 3, 0.1) for layer in range(3)]
    edges += [Edge(layer, t - 1, t - 1, -1, 0.8 - 0.1 * layer) for layer in range(4)]
    edges.append(Edge(1, 900, t - 1, 2, -0.05))
    return Attribution(
        model="synthetic",
        tokens=[f" w{i}" for i in range(t)],
        ids=list(range(t)),
        targets=[Target(position=p, token=1) for p in positions],
        target_tokens=[" next"] * targets,
        values=[-1.5] * targets,
        scores=scores,
        routes=[Routes(k, p, 0.02, edges, 4) for k, p in enumerate(positions)] if routes else None,
    )


@pytest.fixture(autouse=True)
def _artifacts_folder():
    ARTIFACTS.mkdir(exist_ok=True)  # the figures and pages are written there for a look


# ---- figures ------------------------------------------------------------------------------
def _strips(fig):
    return [ax for ax in fig.axes if ax.get_images()]


@pytest.mark.parametrize("which", ["single", "continued"])
def test_the_strip_figure_draws_every_method_for_any_target(which, request):
    result: Attribution = request.getfixturevalue(which)
    for k in (0, len(result.targets) - 1):
        path = ARTIFACTS / f"attribution-{which}-{k}.png"
        fig = figures.plot(result, path=path, target=k)  # registered for Attribution
        assert path.stat().st_size > 5_000
        strips = _strips(fig)
        assert len(strips) == len(result.methods)
        assert all(ax.get_ylabel() in result.methods for ax in strips)
        assert result.describe_target(k) in fig.texts[0].get_text()
        assert result.model in fig.texts[0].get_text()
        p = result.targets[k].position
        grey = np.ma.getmaskarray(strips[0].get_images()[0].get_array())
        assert grey[0, p + 1 :].all() and not grey[0, : p + 1].any()  # grey after the target
        labels = [t.get_text() for t in strips[-1].get_xticklabels()]
        assert len(labels) == len(result.tokens)  # a short text: every token labelled


def test_the_strip_figure_checks_its_arguments(continued):
    with pytest.raises(ValueError, match="out of range"):
        attribution_figure(continued, target=len(continued.targets))
    with pytest.raises(KeyError, match="no 'integrated_gradients' scores"):
        attribution_figure(continued, methods=["integrated_gradients"])


def test_a_long_text_draws_quickly_with_its_strongest_tokens_labelled():
    result = _synthetic(2048)
    start = time.perf_counter()
    fig = attribution_figure(result, path=ARTIFACTS / "attribution-2048.png")
    seconds = time.perf_counter() - start
    assert seconds < 15, f"{seconds:.1f} s for 2,048 tokens"
    strips = _strips(fig)  # per method: the whole text, then the tokens up to the target
    assert len(strips) == 4
    for ax, peak in zip(strips[::2], (37, 537), strict=True):
        ticks = [int(x) for x in ax.get_xticks()]
        assert peak in ticks and 2047 in ticks  # the strongest token and the target
        assert len(ticks) <= STRONGEST_LABELS + 1
        view = ax.get_images()[0].get_array()
        assert view.shape[1] <= 1024  # binned, the peak kept whole
        assert np.nanmax(np.abs(view)) == pytest.approx(1.0)
    for ax in strips[1::2]:
        assert [int(x) for x in ax.get_xticks()] == list(range(2048 - ZOOM_TOKENS, 2048))


def test_the_strip_bins_keep_the_strongest_score_and_its_sign():
    row = np.array([[0.1, -0.9, 0.2, 0.3, np.nan, np.nan, 0.5]])
    view, span = strip_view(row, cells=3)
    assert span == 9
    assert np.allclose(view[0, :2], [-0.9, 0.3]) and view[0, 2] == 0.5
    same, t = strip_view(row, cells=10)
    assert t == 7 and same is row


def test_the_routes_figure_draws_edges_by_sign_and_kind(continued):
    k = len(continued.targets) - 1
    routes = continued.routes[k]
    fig = routes_figure(continued, ARTIFACTS / "routes-continued.png", target=k)
    ax = fig.axes[0]
    drawn = sum(len(c.get_segments()) for c in ax.collections if hasattr(c, "get_segments"))
    assert drawn == len(routes.edges)
    labels = [t.get_text() for t in ax.get_xticklabels()]
    positions = sorted({pos for _, pos in routes.nodes()})
    assert len(labels) == len(positions)
    assert f"position {routes.position}" in ax.get_title()
    assert ax.get_ylim()[1] > routes.num_layers  # the target's level is in view


def test_the_routes_of_a_long_text_show_only_the_positions_they_touch():
    result = _synthetic(2048)
    fig = routes_figure(result)
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert ticks == ["37  w37", "900  w900", "2047  w2047"]


def test_the_routes_figure_needs_routes(single):
    with pytest.raises(ValueError, match="routes=True"):
        routes_figure(single)


# ---- the HTML page ------------------------------------------------------------------------
def _page(result: Attribution, name: str) -> tuple[Path, str]:
    path = write_attribution_html(result, ARTIFACTS / f"attribution-{name}.html")
    return path, path.read_text("utf-8")


@pytest.mark.parametrize("which", ["single", "continued"])
def test_the_page_is_self_contained(which, request):
    result: Attribution = request.getfixturevalue(which)
    _, page = _page(result, which)
    assert "http://" not in page and "https://" not in page
    assert not re.search(r"\s(src|href)\s*=", page, re.I)
    assert "<link" not in page and "@import" not in page and "url(" not in page
    assert "fetch(" not in page and "XMLHttpRequest" not in page
    assert "default-src 'none'" in page  # and the page forbids loading anything
    assert page.count("<script") == page.count("</script>") == 2


def test_the_page_shows_every_token_escaped(continued):
    _, page = _page(continued, "continued")
    for token in continued.tokens:
        for piece in token.split("\n"):
            assert html.escape(piece, quote=True) in page
    for raw in ("<b>", '"q"', "\t<"):
        assert f">{raw}<" not in page  # never as markup
    text = re.search(r'id="cw-tokens"[^>]*>(.*?)</div>', page, re.S)
    assert text is not None
    assert len(re.findall(r'<span class="tok" data-i="\d+">', text.group(1))) == len(
        continued.tokens
    )


def test_the_embedded_data_parses_and_matches_the_result(continued):
    path, _ = _page(continued, "continued")
    data = read_attribution_html(path)
    assert data["tokens"] == continued.tokens
    assert data["methods"] == continued.methods
    for k, target in enumerate(continued.targets):
        p = target.position
        assert data["targets"][k]["position"] == p
        assert data["targets"][k]["output"] == p + 1  # the continuation's token
        assert data["targets"][k]["description"] == continued.describe_target(k)
        for m in continued.methods:
            got = np.array(data["scores"][m][k], dtype=float)
            assert got.shape == (p + 1,)
            assert np.allclose(got, continued[m][k, : p + 1].numpy(), rtol=1e-5, atol=1e-12)
        edges = data["routes"][k]["edges"]
        assert len(edges) == len(continued.routes[k].edges)
        assert edges[0][:4] == [
            getattr(continued.routes[k].edges[0], f) for f in ("layer", "source", "target", "head")
        ]


def test_a_page_without_routes_says_how_to_get_them(single):
    _, page = _page(single, "single")
    data = read_attribution_html(page)
    assert data["routes"] is None
    assert "routes=True" in page
    assert data["targets"][0]["output"] is None  # the prediction is not in the text


# ---- in a browser -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser():
    from webdriver_client import Browser, find_browser

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


def _shown_scores(b) -> dict[int, float]:
    pairs = b.js(
        "return Array.from(document.querySelectorAll('#cw-tokens .tok'))"
        ".filter(e => e.dataset.s !== undefined)"
        ".map(e => [Number(e.dataset.i), Number(e.dataset.s)]);"
    )
    return {int(i): float(s) for i, s in pairs}


def _expect(result: Attribution, method: str, k: int) -> dict[int, float]:
    p = result.targets[k].position
    return {i: float(v) for i, v in enumerate(result[method][k, : p + 1].tolist())}


def _matches(shown: dict[int, float], want: dict[int, float]) -> bool:
    return shown.keys() == want.keys() and all(
        abs(shown[i] - want[i]) <= 1e-5 * max(abs(want[i]), 1e-9) for i in want
    )


def test_clicking_an_output_shows_its_target(browser, continued):
    path, _ = _page(continued, "continued")
    browser.open(path)
    browser.wait("document.body.dataset.ready === '1'")
    assert _matches(_shown_scores(browser), _expect(continued, "flow", 0))
    edges = "return document.querySelectorAll('#cw-routes path.edge').length;"
    assert browser.js(edges) == len(continued.routes[0].edges)

    browser.click('#cw-outputs .out[data-k="1"]')  # an output chip
    assert browser.js("return document.body.dataset.target;") == "1"
    assert _matches(_shown_scores(browser), _expect(continued, "flow", 1))
    assert browser.js(edges) == len(continued.routes[1].edges)

    last = len(continued.targets) - 1
    output = continued.targets[last].position + 1
    browser.click(f'#cw-tokens .tok[data-i="{output}"]')  # the same token, in the text
    assert browser.js("return document.body.dataset.target;") == str(last)
    after = "return document.querySelectorAll('#cw-tokens .tok.after').length;"
    assert browser.js(after) == len(continued.tokens) - output

    browser.select("#cw-method", "rollout")
    assert _matches(_shown_scores(browser), _expect(continued, "rollout", last))

    browser.hover('#cw-tokens .tok[data-i="2"]')
    tip = browser.js("return document.getElementById('cw-tip').textContent;")
    assert all(m in tip for m in continued.methods) and "position 2" in tip

    texts = browser.js(
        "return Array.from(document.querySelectorAll('#cw-tokens .tok')).map(e => e.textContent);"
    )
    for token, text in zip(continued.tokens, texts, strict=True):  # tokens read as text
        assert text == (token.replace("\n", "↵\n") if token else "∅")
    browser.screenshot(ARTIFACTS / "attribution-page.png")
    errors = [e["message"] for e in browser.console() if e.get("level") in ("SEVERE", "ERROR")]
    assert not errors, errors


def test_the_attribution_page_lists_the_strongest_tokens_by_size(browser, tmp_path):
    """The page's "Strongest" list is the summary's top tokens: largest |score| first (a
    token that pushes the target down counts), and its console stays free of errors."""
    model = tiny_model("llama", dtype=torch.float64)
    a = attribute(model, torch.arange(3, 15), target=8, methods="flow,input_x_gradient")
    page = write_attribution_html(a, tmp_path / "attribution.html")
    b = browser
    b.open(page)
    b.wait("document.getElementById('cw-top').querySelectorAll('code').length > 0")
    shown = b.js(
        "return Array.from(document.querySelectorAll('#cw-top code')).map(c => c.textContent);"
    )
    top = a.top(10, "flow")  # 8 positions up to the target, token 0 aside
    assert len(top) == 8 and 0 not in [p for p, _, _ in top]
    assert top[0][2] < 0  # the strongest pushes the target down: a signed sort lists it last
    assert [int(re.search(r"@(\d+)", t)[1]) for t in shown] == [p for p, _, _ in top]
    assert not [e for e in b.console() if e.get("level") in ("SEVERE", "ERROR")]


def test_the_strip_figure_states_what_a_sign_means(model):
    """The default's sign convention is on the plot: red raises the target's quantity, blue
    lowers it; a magnitude twin's row says it has no sign."""
    result = attribute(model, "hello world", methods="direct,direct_abs")
    fig = attribution_figure(result)
    title = fig._suptitle.get_text()
    assert f"red: raises log P of {result.target_tokens[0]!r}, blue: lowers it" in title
    rows = [ax.get_title(loc="left") for ax in fig.axes if ax.get_title(loc="left")]
    assert [("either way" in r) for r in rows] == [False, True]
    logit = attribute(model, "hello world", methods="direct", quantity="logit")
    assert "raises the logit of" in logit.sign_convention(0)
    contrast = attribute(model, "hello world", methods="direct", quantity="contrast", foil=3)
    assert contrast.sign_convention(0).startswith("red: favours ")
    flow = attribute(model, "hello world", methods="flow", quantity="flow")
    assert "opposes it" in flow.sign_convention(0)
    figures.plt.close("all")
