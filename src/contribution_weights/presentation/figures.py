"""Figures of a single trace: heatmaps side by side (paper Fig. 1) and first-token weight.

Everything here reads a :class:`~contribution_weights.tracing.result.Trace`; nothing touches a
model. Functions return the matplotlib Figure; :func:`save` writes it as a PNG.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.colors as mcolors
import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.figure import Figure

from ..measures.registry import get_measure
from ..tracing.result import Trace

FIRST_TOKEN_MEASURES = ("attention", "vw", "contribution")
ALL_LABELS_UP_TO = 64  # texts up to this many tokens get every token on the axes
SUBSET_LABELS = 32  # longer texts: about this many evenly spaced tokens, with their index
CLIP_PERCENTILE = 99.5  # colour limits: this percentile of |w| (larger values saturate)
MASKED = "#eceef2"  # keys after the query (not attended), as in the HTML report
HEATMAP_CELLS = 1024  # a heatmap shows at most this many cells a side (longer: bin means)


# ---- the figure of each kind of result ------------------------------------------------------
#: result type -> function drawing its figure (``draw(result, path=None) -> Figure``); each
#: figure module registers its own (faithfulness_plots, kv_plots, geometry_plots,
#: attribution_plots)
_FIGURES: dict[type, Callable[..., Any]] = {}
_FIGURE_MODULES = (
    "faithfulness_plots",
    "kv_plots",
    "geometry_plots",
    "attribution_plots",
    "attribution_eval_plots",
)


def register_figure(result_type: type, draw: Callable[..., Any]) -> Callable[..., Any]:
    """Make ``draw(result, path=None)`` the figure of ``result_type`` (and its subclasses)
    for :func:`plot`, ``cw.plot`` and the command line."""
    _FIGURES[result_type] = draw
    return draw


def figure_for(result: Any) -> Callable[..., Any] | None:
    """The registered figure of ``result``'s type (or of its nearest base), or None."""
    import importlib

    for module in _FIGURE_MODULES:  # the built-in figures register when imported
        importlib.import_module(f"{__package__}.{module}")
    return next((_FIGURES[t] for t in type(result).__mro__ if t in _FIGURES), None)


def plot(result: Any, path: str | Path | None = None, **options: Any) -> Any:
    """The figure of an experiment's result (a matplotlib Figure), saved to ``path`` if given."""
    draw = figure_for(result)
    if draw is None:
        raise ValueError(
            f"no figure is registered for {type(result).__name__}; register one with "
            "contribution_weights.presentation.figures.register_figure(ResultType, draw)"
        )
    return draw(result, path=path, **options)


def measure_style(measure: str, i: int = 0) -> tuple[str, str]:
    """A measure's colour and marker, the same in every figure (:attr:`Measure.style`);
    a measure registered without one, or a name that is no measure (a baseline), takes a
    colour of the cycle by its position ``i``."""
    try:
        style = get_measure(measure).style
    except ValueError:
        style = None
    return (style.colour, style.marker) if style is not None else (f"C{(i + 5) % 10}", "x")


def save(fig: Figure, path: str | Path, dpi: int = 130) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Glyph .* missing from font")
        fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return path


def finish(
    fig: Any, path: str | Path | None, title: str | None, *, dpi: int = 110, fontsize: int = 11
) -> Any:
    """Title, layout, and saving (then closing) when a path is given; returns ``fig``.
    Shared by the experiment figures (faithfulness, downstream, kv-eval)."""
    if title:
        fig.suptitle(title, fontsize=fontsize)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=dpi)
        plt.close(fig)
    return fig


def sink_heads(trace: Trace, count: int = 3) -> list[tuple[int, int]]:
    """(layer, head) pairs where attention and contribution disagree most on token 0.

    One head per layer, for ``count`` layers spread over the traced ones; falls back to
    head 0 when the trace lacks attention or contribution.
    """
    n = len(trace.layers)
    picks = sorted({round(k * (n - 1) / max(1, count - 1)) for k in range(min(count, n))})
    pairs = []
    for pos in picks:
        head = 0
        if {"attention", "contribution"} <= set(trace.measures):
            # mean over queries of each head's weight on token 0, from the reductions
            first = {
                m: trace.kept_reductions(m).first[pos].mean(-1)
                for m in ("attention", "contribution")
            }
            head = int((first["attention"] - first["contribution"]).argmax())
        pairs.append((trace.layers[pos], head))
    return pairs


def token_label(token: str) -> str:
    """A token as an axis label: whitespace made visible, no matplotlib mathtext."""
    shown = token.replace("\n", "↵").replace("\t", "⇥").replace("\r", "")
    if not shown.strip():
        shown = shown.replace(" ", "·") or "∅"
    return shown.replace("$", r"\$")


def tick_positions(num_tokens: int) -> list[int]:
    """Which tokens label the axes: all of a short text, evenly spaced ones beyond."""
    if num_tokens <= ALL_LABELS_UP_TO:
        return list(range(num_tokens))
    step = math.ceil(num_tokens / SUBSET_LABELS)
    return list(range(0, num_tokens, step))


def colour_limit(values: np.ndarray, percentile: float = CLIP_PERCENTILE) -> float:
    """A robust colour limit: the ``percentile`` of |w| over the finite values (1 if all 0)."""
    finite = np.abs(values[np.isfinite(values)])
    if not finite.size or finite.max() <= 0:
        return 1.0
    limit = float(np.percentile(finite, percentile))
    return limit if limit > 0 else float(finite.max())


def _signed_sqrt_norm(limit: float) -> mcolors.Normalize:
    """Symmetric about 0, square-root contrast: small weights stay visible next to a sink."""

    def forward(x: np.ndarray) -> np.ndarray:
        return np.sign(x) * np.sqrt(np.abs(x))

    def inverse(x: np.ndarray) -> np.ndarray:
        return np.sign(x) * np.square(x)

    return mcolors.FuncNorm((forward, inverse), vmin=-limit, vmax=limit, clip=False)


def _axis_labels(ax: Any, tokens: Sequence[str], t: int) -> None:
    ticks = tick_positions(t)
    if t <= ALL_LABELS_UP_TO:
        labels = [token_label(tokens[i]) for i in ticks]
        size = max(4.0, min(8.0, 360 / max(t, 1)))
    else:
        labels = [f"{i} {token_label(tokens[i])}" for i in ticks]
        size = 6.0
    ax.set_xticks(ticks, labels, rotation=90, fontsize=size)
    ax.set_yticks(ticks, labels, fontsize=size)


def head_view(
    trace: Trace, name: str, pos: int, head: int, cells: int | None = None
) -> tuple[np.ndarray, int]:
    """``(view, span)``: one head's map as drawn, read in bounded row blocks.

    Up to ``cells`` (default :data:`HEATMAP_CELLS`) tokens the view is the ``(T, T)`` map
    itself; beyond, each cell is the mean of the attended (key ≤ query) weights in a bin
    of ``b`` queries × ``b`` keys, ``b = ceil(T / cells)``, so the view is at most
    ``cells × cells``. Keys after the query are NaN. ``span`` is the number of tokens
    the view covers (``T`` rounded up to a whole bin), for the image's extent.
    """
    t = trace.num_tokens
    limit = HEATMAP_CELLS if cells is None else cells
    b = max(1, math.ceil(t / max(1, limit)))
    n = math.ceil(t / b)
    sums = np.zeros((n, n))
    counts = np.zeros((n, n))
    keys = np.arange(n * b)
    for q0, block in trace.iter_blocks(name, pos, slice(head, head + 1)):
        w = block[0].detach().to("cpu", torch.float64).numpy()
        rows = w.shape[0]
        queries = np.arange(q0, q0 + rows)
        seen = keys[None, :] <= queries[:, None]
        seen[:, t:] = False
        full = np.zeros((rows, n * b))
        full[:, :t] = w
        full[~seen] = 0.0
        row_bins = queries // b
        np.add.at(sums, row_bins, full.reshape(rows, n, b).sum(-1))
        np.add.at(counts, row_bins, seen.reshape(rows, n, b).sum(-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        view = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
    return view, n * b


def plot_heatmaps(
    trace: Trace,
    pairs: Sequence[tuple[int, int]] | None = None,
    measures: Sequence[str] = ("attention", "contribution"),
) -> Figure:
    """One row per (layer, head), one column per measure (paper Figure 1).

    Axes are labelled with the tokens (every token up to :data:`ALL_LABELS_UP_TO` tokens,
    an evenly spaced subset with indices beyond). Colours use a square-root contrast up
    to a robust limit, the :data:`CLIP_PERCENTILE` percentile of |w| in the panel (larger
    values saturate; the colour bar's arrow says so): signed measures on a diverging
    scale symmetric about 0 (red adds to the output, blue opposes it), unsigned ones
    from 0. Grey cells are keys after the query. A trace longer than
    :data:`HEATMAP_CELLS` tokens is shown binned (:func:`head_view`), read in bounded
    blocks: a figure of a long streamed trace never loads a whole head or layer.
    """
    measures = [m for m in measures if m in trace] or list(trace.measures)[:2]
    pairs = list(pairs) if pairs else sink_heads(trace)
    t = trace.num_tokens
    size = min(9.0, 3.0 + t / 12) if t <= ALL_LABELS_UP_TO else 7.0
    fig, axes = plt.subplots(
        len(pairs),
        len(measures),
        figsize=(size * len(measures) + 1.5, size * len(pairs)),
        squeeze=False,
    )
    for r, (layer, head) in enumerate(pairs):
        pos = trace.layer_position(layer)
        if not 0 <= head < trace.num_heads:
            raise ValueError(f"head {head} out of range: the model has {trace.num_heads} heads")
        for c, name in enumerate(measures):
            ax = axes[r][c]
            w, span = head_view(trace, name, pos, head)
            limit = colour_limit(w)
            signed = get_measure(name).signed or bool(np.nanmin(w) < 0)
            if signed:
                cmap = plt.get_cmap("RdBu_r").with_extremes(bad=MASKED)
                norm: mcolors.Normalize = _signed_sqrt_norm(limit)
            else:
                cmap = plt.get_cmap("viridis").with_extremes(bad=MASKED)
                norm = mcolors.PowerNorm(0.5, vmin=0.0, vmax=limit, clip=False)
            extent = (-0.5, span - 0.5, span - 0.5, -0.5)  # token coordinates when binned
            im = ax.imshow(w, cmap=cmap, norm=norm, interpolation="nearest", extent=extent)
            ax.set_xlim(-0.5, t - 0.5)
            ax.set_ylim(t - 0.5, -0.5)
            ax.set_title(f"{name} — layer {layer}, head {head}", fontsize=9)
            ax.set_xlabel("key")
            ax.set_ylabel("query")
            _axis_labels(ax, trace.tokens, t)
            over = np.nanmax(np.abs(w)) > limit if np.isfinite(w).any() else False
            extend = ("both" if signed else "max") if over else "neither"
            bar = fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02, extend=extend)
            bar.set_label(f"√ contrast, clipped at {CLIP_PERCENTILE:g}th pct of |w|", fontsize=7)
            bar.ax.tick_params(labelsize=7)
    fig.suptitle(f"{trace.model_name}: {' vs '.join(measures)}", fontsize=11)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Glyph .* missing from font")
        fig.tight_layout(rect=(0, 0, 1, 0.985))
    return fig


def plot_first_token_weight(trace: Trace, measures: Sequence[str] = FIRST_TOKEN_MEASURES) -> Figure:
    """Per-layer first-token weight of the normalised measures (paper Table 4, by layer)."""
    names = [m for m in measures if m in trace.measures and get_measure(m).is_weight]
    if not names:
        raise ValueError(
            f"the trace has none of the measures {', '.join(measures)}; "
            "trace with them to plot this"
        )
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for i, name in enumerate(names):
        values = trace.first_token_weight(name)
        colour, marker = measure_style(name, i)
        label = f"{name} (mean {values.mean():.3f})"
        ax.plot(trace.layers, values, marker=marker, ms=3, color=colour, label=label)
    ax.set_xlabel("layer")
    ax.set_ylabel("weight on token 0")
    ax.set_ylim(bottom=min(0.0, ax.get_ylim()[0]))
    ax.set_title(f"{trace.model_name}: first-token weight by layer ({trace.num_tokens} tokens)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
