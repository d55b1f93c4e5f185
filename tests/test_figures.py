"""Figures that read at a glance: token labels, colour scales that show the contribution
panels, error bars and a sensible x axis in the faithfulness figures."""

from __future__ import annotations

import matplotlib.colors as mcolors
import numpy as np
import pandas as pd
import pytest
import torch

import contribution_weights as cw
from contribution_weights.presentation import figures
from contribution_weights.presentation.faithfulness_plots import (
    binomial_se,
    plot_downstream,
    plot_faithfulness,
)

ARTIFACTS = figures.Path(__file__).resolve().parents[1] / "test-artifacts"


@pytest.fixture(autouse=True)
def _artifacts_folder():
    ARTIFACTS.mkdir(exist_ok=True)  # the figures are written there for a look


def synthetic_trace(t: int, tokens: list[str] | None = None) -> cw.Trace:
    """Two layers, two heads; contribution small everywhere but one large outlier per
    panel (the case that left the panels nearly white under a max-based scale)."""
    gen = torch.Generator().manual_seed(0)
    tril = torch.ones(t, t).tril()
    attention = torch.rand(2, 2, t, t, generator=gen) * tril
    attention = attention / attention.sum(-1, keepdim=True)
    contribution = (torch.rand(2, 2, t, t, generator=gen) - 0.3) * 0.01 * tril
    contribution[:, :, t - 1, 0] = 1.0  # one outlier
    return cw.Trace.from_tensors(
        measures={"attention": attention, "contribution": contribution},
        input_ids=torch.arange(t),
        tokens=tokens or [f" w{i}" for i in range(t)],
        layers=[0, 1],
        bias_share=torch.zeros(2, t),
        degenerate=torch.zeros(2, t, dtype=torch.bool),
        model_name="synthetic",
    )


def _panels(fig):
    return [ax for ax in fig.axes if ax.get_images()]


def test_short_texts_show_every_token_on_both_axes():
    tokens = ["<s>", " The", " cat", "\n", " costs", " $5", " ", "🐈"]
    fig = figures.plot_heatmaps(synthetic_trace(len(tokens), tokens), [(0, 1)])
    ax = _panels(fig)[0]
    want = ["<s>", " The", " cat", "↵", " costs", r" \$5", "·", "🐈"]
    assert [x.get_text() for x in ax.get_xticklabels()] == want
    assert [y.get_text() for y in ax.get_yticklabels()] == want
    figures.save(fig, ARTIFACTS / "heatmaps-short.png")  # renders ($ is not mathtext)


def test_long_texts_show_a_readable_subset_with_indices():
    t = 300
    fig = figures.plot_heatmaps(synthetic_trace(t), [(1, 0)])
    ax = _panels(fig)[0]
    labels = [x.get_text() for x in ax.get_xticklabels()]
    assert 20 <= len(labels) <= figures.SUBSET_LABELS + 1
    assert labels[0] == "0  w0" and labels[1] == f"{figures.tick_positions(t)[1]}  w10"
    figures.save(fig, ARTIFACTS / "heatmaps-long.png")


def test_contribution_panels_are_not_white():
    """A robust limit and √ contrast: most cells visibly coloured despite the outlier."""
    trace = synthetic_trace(40)
    fig = figures.plot_heatmaps(trace, [(0, 0)])
    attention_ax, contribution_ax = _panels(fig)
    im = contribution_ax.get_images()[0]
    norm = im.norm
    assert isinstance(norm, mcolors.FuncNorm) and norm.vmin == -norm.vmax  # symmetric
    values = trace["contribution"][0, 0].double().numpy()
    lower = values[np.tril_indices(40)]
    assert norm.vmax == pytest.approx(np.percentile(np.abs(lower), 99.5))
    assert norm.vmax < 0.5  # the outlier (1.0) saturates instead of setting the scale
    rgb = im.to_rgba(lower)[:, :3]
    visible = np.abs(rgb - 1).max(axis=1) > 0.15  # visibly different from white
    assert visible.mean() > 0.5
    # a max-based linear scale, as before, would leave almost every cell white
    old = mcolors.Normalize(-1.0, 1.0)
    old_rgb = im.cmap(old(lower))[:, :3]
    assert (np.abs(old_rgb - 1).max(axis=1) > 0.15).mean() < 0.05
    # unsigned attention: from 0, √ contrast; masked cells grey, not white
    a_norm = attention_ax.get_images()[0].norm
    assert isinstance(a_norm, mcolors.PowerNorm) and a_norm.vmin == 0
    assert tuple(contribution_ax.get_images()[0].cmap.get_bad()[:3]) != (1.0, 1.0, 1.0)


def test_sink_heads_reads_one_head_at_a_time():
    trace = synthetic_trace(12)
    att = trace.maps.tensors["attention"]
    att[1, 1, :, 0] = 1.0  # head 1 of layer 1: all attention on token 0
    att[1, 1, :, 1:] = 0.0
    pairs = figures.sink_heads(trace, count=2)
    assert pairs[-1] == (1, 1)


def _summary(rates):
    rows = []
    for mode in ("comprehensiveness", "sufficiency"):
        for k, measure in enumerate(("attention", "ihc")):
            for rate in rates:
                rows.append(
                    {
                        "measure": measure,
                        "mode": mode,
                        "rate": rate,
                        "n": 8,
                        "delta_ppl_mean": 10.0 * (k + 1) * (1 + rate),
                        "delta_ppl_se": 1.0 + k,
                        "delta_nll_mean": 0.1,
                        "delta_nll_se": 0.01,
                    }
                )
    return pd.DataFrame(rows)


def _error_bars(ax):
    from matplotlib.container import ErrorbarContainer

    return [c for c in ax.containers if isinstance(c, ErrorbarContainer)]


def test_faithfulness_has_error_bars_from_the_standard_errors():
    fig = plot_faithfulness(_summary([0.1, 0.3, 0.5]))
    ax = fig.axes[0]
    bars = _error_bars(ax)
    assert len(bars) == 2  # one per measure
    segments = bars[1].lines[2][0].get_segments()  # ihc: s.e. 2
    assert [round(float(s[1, 1] - s[0, 1]), 6) for s in segments] == [4.0, 4.0, 4.0]
    assert [x.get_text() for x in ax.get_xticklabels()] == ["0.1", "0.3", "0.5"]
    fig.savefig(ARTIFACTS / "faithfulness-rates.png")


def test_faithfulness_with_one_rate_puts_the_measures_on_the_x_axis():
    fig = plot_faithfulness(_summary([0.2]))
    ax = fig.axes[0]
    assert [x.get_text() for x in ax.get_xticklabels()] == ["attention", "ihc"]
    assert "p = 0.2" in ax.get_xlabel()
    assert len(_error_bars(ax)) == 2
    fig.savefig(ARTIFACTS / "faithfulness-one-rate.png")


def test_downstream_error_bars_and_one_rate():
    rows = [
        {"task": "boolq", "measure": m, "rate": r, "n": 50, "accuracy": a, "clean_accuracy": 0.6}
        for m, a in (("attention", 0.5), ("ihc", 0.58))
        for r in (0.1, 0.5)
    ]
    summary = pd.DataFrame(rows)
    fig = plot_downstream(summary)
    assert len(_error_bars(fig.axes[0])) == 2
    one = plot_downstream(summary[summary.rate == 0.5])
    assert [x.get_text() for x in one.axes[0].get_xticklabels()] == ["attention", "ihc"]
    assert binomial_se(np.array([0.5]), np.array([100]))[0] == pytest.approx(0.05)


def test_runs_share_axes_a_line_style_per_run_and_refuse_too_many():
    from contribution_weights.presentation.faithfulness_plots import plot_faithfulness_runs

    layer, other = _summary([0.1, 0.3, 0.5]), _summary([0.1, 0.3, 0.5])
    other["delta_ppl_mean"] *= 3
    fig = plot_faithfulness_runs({"layer scope": layer, "global scope": other})
    ax = fig.axes[0]
    bars = _error_bars(ax)
    assert len(bars) == 2 * 2  # measures × runs
    styles = {b.lines[0].get_linestyle() for b in bars}
    assert styles == {"-", "--"}
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["attention", "ihc", "layer scope", "global scope"]
    fig.savefig(ARTIFACTS / "faithfulness-runs.png")
    with pytest.raises(ValueError, match="at most"):
        plot_faithfulness_runs({str(k): layer for k in range(5)})
