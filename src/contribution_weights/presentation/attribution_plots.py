"""Figures of an end-to-end attribution (:class:`~..attribution.result.Attribution`).

:func:`attribution_figure` (the registered figure of an Attribution, ``cw.plot(result)``)
draws one heat strip per method: the score of every input token for one target, signed
(red drives the target up, blue down), each method on its own scale. :func:`routes_figure`
draws a target's routes (method §7.4): the flow graph's heaviest edges, from the
embeddings (level 0, bottom) up to the target's final state (level L, top).

Everything here reads the result; nothing touches a model.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.colors as mcolors
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle

from ..attribution.methods import is_magnitude
from ..attribution.result import Attribution, Routes
from .attribution_html import method_note
from .figures import MASKED, _signed_sqrt_norm, register_figure, save, token_label

ALL_LABELS_UP_TO = 60  # texts up to this many tokens get every token on the axis
STRONGEST_LABELS = 24  # longer texts: about this many of each method's strongest tokens
STRIP_CELLS = 1024  # a strip shows at most this many cells (longer: bins, largest |score|)
ZOOM_TOKENS = 40  # longer texts: a second panel shows this many tokens up to the target
POSITIVE, NEGATIVE = "#b2182b", "#2166ac"  # the ends of RdBu_r: the signs everywhere here
NO_ROUTES = (
    "this attribution has no routes: attribute with routes=True (command line: --routes) "
    "to draw them"
)


# ---- helpers --------------------------------------------------------------------------------
def _check_target(result: Attribution, target: int) -> int:
    n = len(result.targets)
    if not -n <= target < n:
        raise ValueError(f"target {target} out of range: this attribution has {n} target(s)")
    return target % n


def strip_view(row: np.ndarray, cells: int = STRIP_CELLS) -> tuple[np.ndarray, int]:
    """``(view, span)``: a row of scores as drawn. Up to ``cells`` tokens the row itself;
    beyond, bins of ``b = ceil(T / cells)`` tokens, each showing the score of largest
    magnitude in it (sign kept, NaN only where the whole bin is NaN), so that a single
    strong token is never averaged or resampled away. ``span`` is the number of tokens the
    view covers (``T`` rounded up to a whole bin), for the image's extent."""
    t = row.shape[-1]
    b = max(1, math.ceil(t / max(1, cells)))
    if b == 1:
        return row, t
    n = math.ceil(t / b)
    padded = np.full((*row.shape[:-1], n * b), np.nan)
    padded[..., :t] = row
    bins = padded.reshape(*row.shape[:-1], n, b)
    magnitude = np.where(np.isfinite(bins), np.abs(bins), -1.0)
    pick = np.take_along_axis(bins, magnitude.argmax(-1)[..., None], -1)[..., 0]
    return pick, n * b


def _strongest(row: np.ndarray, count: int, spacing: float, always: int | None) -> list[int]:
    """The positions of up to ``count`` of the largest |scores|, at least ``spacing``
    tokens apart (so that their labels do not overlap), ``always`` included."""
    chosen: list[int] = [] if always is None else [always]
    finite = np.where(np.isfinite(row), np.abs(row), -1.0)
    for j in np.argsort(-finite, kind="stable"):
        if len(chosen) >= count or finite[j] <= 0:
            break
        if all(abs(int(j) - c) >= spacing for c in chosen):
            chosen.append(int(j))
    return sorted(chosen)


def _limit(values: np.ndarray) -> float:
    finite = np.abs(values[np.isfinite(values)])
    top = float(finite.max()) if finite.size else 0.0
    return top if top > 0 else 1.0


def _quiet_layout(fig: Figure, **kwargs: Any) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Glyph .* missing from font")
        warnings.filterwarnings("ignore", message="Tight layout not applied")
        fig.tight_layout(**kwargs)


def _finish(fig: Figure, path: str | Path | None) -> Figure:
    if path is not None:
        save(fig, path)
    return fig


# ---- the heat strips --------------------------------------------------------------------
def attribution_figure(
    result: Attribution,
    path: str | Path | None = None,
    target: int = 0,
    methods: list[str] | None = None,
    contrast: str = "sqrt",
) -> Figure:
    """One row per method: a heat strip of that method's scores for ``target`` over the
    input tokens.

    Colours are signed (red: the token drives the target up, blue: down) and each method
    is scaled by its own max |score| (the colour bar gives it), with a square-root
    contrast by default (``contrast="linear"`` for a linear one) so that tokens next to a
    sink stay visible. Tokens after the target's position, which cannot drive it, are grey;
    the target's position is boxed and marked ▼. Up to :data:`ALL_LABELS_UP_TO` tokens every
    token is labelled. A longer text gets two panels per method on the same scale: the
    whole text, labelled with its :data:`STRONGEST_LABELS` strongest tokens (with their
    positions; each drawn at least a few pixels wide; beyond :data:`STRIP_CELLS` tokens
    in bins that show their strongest token's score), and, beside it, the
    :data:`ZOOM_TOKENS` tokens up to the target with every token labelled (where the
    strongest tokens usually are, too close together to label on the whole text).
    """
    k = _check_target(result, target)
    names = list(methods) if methods else result.methods
    for name in names:
        result[name]  # raises, naming the methods there are
    if contrast not in ("sqrt", "linear"):
        raise ValueError(f"contrast must be 'sqrt' or 'linear', not {contrast!r}")
    t = len(result.tokens)
    p = result.targets[k].position
    short = t <= ALL_LABELS_UP_TO
    longest = max((len(token_label(x)) for x in result.tokens), default=1)
    label_room = min(1.6, 0.2 + 0.075 * (min(longest, 16) + (0 if short else 5)))
    height = (0.75 + label_room) * len(names) + 0.9
    if short:
        fig, axes = plt.subplots(
            len(names),
            1,
            figsize=(max(7.0, min(18.0, 2.8 + 0.24 * t)), height),
            squeeze=False,
            layout="constrained",
        )
    else:
        fig, axes = plt.subplots(
            len(names),
            2,
            figsize=(18.0, height),
            squeeze=False,
            layout="constrained",
            gridspec_kw={"width_ratios": (2.6, 1.0)},
        )
    zoom = (max(0, p - ZOOM_TOKENS + 1), min(t, p + 3))  # a few grey ones after the target
    cmap = plt.get_cmap("RdBu_r").with_extremes(bad=MASKED)
    for r, name in enumerate(names):
        row = result[name][k].detach().double().cpu().numpy().copy()
        row[p + 1 :] = np.nan  # after the target: cannot drive it
        limit = _limit(row)
        norm: mcolors.Normalize = (
            _signed_sqrt_norm(limit)
            if contrast == "sqrt"
            else mcolors.Normalize(vmin=-limit, vmax=limit)
        )
        ax = axes[r][0]
        im = _strip(ax, row, 0, t, cmap, norm)
        ax.set_ylabel(name, rotation=0, ha="right", va="center", fontsize=9)
        note = method_note(result, name, k)
        if is_magnitude(name):
            note = "; ".join(filter(None, ["|score|: mattered either way", note]))
        ax.set_title(
            f"{name}: max |score| {limit:.3g}" + (f"  ({note})" if note else ""),
            fontsize=8,
            loc="left",
        )
        if short:
            size = max(5.0, min(8.0, 420 / t))
            _labels(ax, list(range(t)), [token_label(x) for x in result.tokens], p, size)
        else:
            outside = row.copy()
            outside[zoom[0] :] = np.nan  # the zoom labels those
            ticks = _strongest(outside, STRONGEST_LABELS, t / 70, always=None)
            _widen(ax, row, ticks, cmap, norm)  # each labelled token at least ~3 px wide
            ticks.append(p)
            labels = [f"{j} {token_label(result.tokens[j])[:16]}" for j in ticks]
            _labels(ax, ticks, labels, p, 6.0)
            ax.set_xlim(-0.5 - t / 250, t - 0.5 + t / 250)  # the first token off the spine
            ax.axvspan(zoom[0] - 0.5, zoom[1] - 0.5, ymin=1.0, ymax=1.06, clip_on=False,
                       color="#9aa3b2", lw=0)  # fmt: skip
            right = axes[r][1]
            im = _strip(right, row, *zoom, cmap, norm)
            window = list(range(*zoom))
            _labels(right, window, [token_label(result.tokens[j]) for j in window], p, 7.0)
            right.set_title(f"tokens {zoom[0]}–{zoom[1] - 1}, up to the target", fontsize=8)
            ax = right
        _mark_target(ax, p)
        bar = fig.colorbar(im, ax=ax, fraction=0.025 if short else 0.06, pad=0.01, aspect=6)
        bar.ax.tick_params(labelsize=6)
        if r == 0:
            bar.set_label("score (√ contrast)" if contrast == "sqrt" else "score", fontsize=6)
    if short:
        axes[-1][0].set_xlabel("token", fontsize=8)
    else:
        where = "token (labelled: the strongest, with positions; grey bar: the zoom beside)"
        binned = math.ceil(t / STRIP_CELLS)
        if binned > 1:
            where += f"; each cell {binned} tokens, showing the largest |score|"
        axes[-1][0].set_xlabel(where, fontsize=8)
        axes[-1][1].set_xlabel("token", fontsize=8)
    kind = "each method on its own scale; grey: after the target"
    fig.suptitle(
        f"{result.model}: {result.describe_target(k)}\nwhich of the {t} tokens drive it: "
        f"{result.sign_convention(k)} ({kind})",
        fontsize=10,
    )
    return _finish(fig, path)


def _strip(ax: Any, row: np.ndarray, lo: int, hi: int, cmap: Any, norm: Any) -> Any:
    """Tokens ``lo`` to ``hi - 1`` of ``row`` as a one-row image in token coordinates."""
    view, span = strip_view(row[None, lo:hi])
    im = ax.imshow(
        view,
        cmap=cmap,
        norm=norm,
        aspect="auto",
        interpolation="nearest",
        extent=(lo - 0.5, lo + span - 0.5, 0.5, -0.5),
    )
    ax.set_xlim(lo - 0.5, hi - 0.5)
    ax.set_ylim(0.5, -0.5)
    ax.set_yticks([])
    return im


def _labels(ax: Any, ticks: list[int], labels: list[str], p: int, size: float) -> None:
    """Rotated token labels, the target's in bold."""
    ax.set_xticks(ticks, labels, rotation=90, fontsize=size)
    for tick, j in zip(ax.get_xticklabels(), ticks, strict=True):
        if j == p:
            tick.set_fontweight("bold")


def _widen(ax: Any, row: np.ndarray, positions: list[int], cmap: Any, norm: Any) -> None:
    """Draw each of ``positions`` as a cell ``T / 500`` tokens wide over the strip."""
    width = max(1.0, row.shape[0] / 500)
    for j in positions:
        if np.isfinite(row[j]):
            colour = cmap(norm(row[j]))
            ax.add_patch(Rectangle((j - width / 2, -0.5), width, 1, color=colour, lw=0, zorder=2))


def _mark_target(ax: Any, p: int) -> None:
    """A box around the target's cell (visible on short strips) and a ▼ above it (on all)."""
    ax.add_patch(
        Rectangle((p - 0.5, -0.5), 1, 1, fill=False, edgecolor="black", linewidth=1.4, zorder=3)
    )
    ax.plot([p], [-0.5], marker="v", color="black", ms=6, clip_on=False, zorder=4)


# ---- the routes -------------------------------------------------------------------------
def _routes_of(result: Attribution, target: int) -> Routes:
    if not result.routes:
        raise ValueError(NO_ROUTES)
    found = [r for r in result.routes if r.target == target]
    if not found:
        raise ValueError(
            f"this attribution has no routes for target {target}: it has routes for "
            f"targets {', '.join(str(r.target) for r in result.routes)}"
        )
    return found[0]


def _bowed(x0: float, y0: float, x1: float, y1: float) -> list[tuple[float, float]]:
    """A quadratic Bézier from (x0, y0) to (x1, y1), bowed to the right, as 9 points."""
    bend = 0.18 if x0 == x1 else 0.1 * math.copysign(1, x1 - x0)
    cx, cy = (x0 + x1) / 2 + bend, (y0 + y1) / 2
    out = []
    for s in np.linspace(0.0, 1.0, 9):
        a, b, c = (1 - s) ** 2, 2 * s * (1 - s), s**2
        out.append((a * x0 + b * cx + c * x1, a * y0 + b * cy + c * y1))
    return out


def routes_figure(result: Attribution, path: str | Path | None = None, target: int = 0) -> Figure:
    """The routes of ``target``: the edges of the flow graph that carry at least the
    threshold (method §7.4), from the embeddings (level 0, bottom) up to the target
    position's final state (level L, top, marked ★).

    x is the token position: every position of a short text, only the positions the
    routes touch (in order) on a text longer than :data:`ALL_LABELS_UP_TO` tokens.
    Edges through a head are solid and bowed; residual edges (a token's own stream) are
    straight and dashed. Colour gives the sign (red carries the flow, blue opposes it),
    width |weight|. Raises ValueError when the result has no routes.
    """
    k = _check_target(result, target)
    routes = _routes_of(result, k)
    t = len(result.tokens)
    top = routes.num_layers
    nodes = routes.nodes()
    positions = sorted({pos for _, pos in nodes})
    compress = t > ALL_LABELS_UP_TO
    x_of = {pos: (i if compress else pos) for i, pos in enumerate(positions)}
    n_x = len(positions) if compress else t
    fig, ax = plt.subplots(
        figsize=(max(8.0, min(18.0, 1.8 + 0.36 * n_x)), max(4.0, min(14.0, 1.6 + 0.24 * top)))
    )
    edges = sorted(routes.edges, key=lambda e: abs(e.weight))
    biggest = max((abs(e.weight) for e in edges), default=1.0) or 1.0
    for residual in (True, False):
        segments: list[list[tuple[float, float]]] = []
        colours: list[str] = []
        widths: list[float] = []
        for e in edges:
            if (e.head < 0) != residual:
                continue
            x0, x1 = x_of[e.source], x_of[e.target]
            y0, y1 = e.layer, e.layer + 1
            if residual:
                segments.append([(x0, y0), (x1, y1)])
            else:  # bowed: a head's edge never hides the residual along the same column
                segments.append(_bowed(x0, y0, x1, y1))
            colours.append(POSITIVE if e.weight >= 0 else NEGATIVE)
            widths.append(0.4 + 5.0 * abs(e.weight) / biggest)
        if segments:
            ax.add_collection(
                LineCollection(
                    segments,
                    colors=colours,
                    linewidths=widths,
                    linestyles=(0, (3, 1.5)) if residual else "solid",
                    alpha=0.85 if residual else 0.7,
                    capstyle="butt",
                    zorder=2,
                )
            )
    xs = [x_of[pos] for _, pos in nodes]
    ys = [lvl for lvl, _ in nodes]
    ax.scatter(xs, ys, s=10, color="#1d2330", zorder=3, linewidths=0)
    ax.scatter(
        [x_of[routes.position]],
        [top],
        s=180,
        marker="*",
        color="#f59e0b",
        edgecolors="black",
        linewidths=0.8,
        zorder=4,
    )
    ax.set_xlim(-0.7, n_x - 0.3)
    ax.set_ylim(-0.6, top + 0.6)
    ticks = [x_of[pos] for pos in positions]
    if compress:
        labels = [f"{pos} {token_label(result.tokens[pos])[:16]}" for pos in positions]
    else:
        labels = [token_label(result.tokens[pos]) for pos in positions]
    ax.set_xticks(ticks, labels, rotation=90, fontsize=max(5.0, min(8.0, 400 / max(n_x, 1))))
    for tick, pos in zip(ax.get_xticklabels(), positions, strict=True):
        if pos == routes.position:
            tick.set_fontweight("bold")
    step = max(1, math.ceil(top / 15))
    ax.set_yticks(list(range(0, top + 1, step)))
    ax.set_ylabel("level (0: embeddings; l: input of layer l; L: final state)")
    ax.set_xlabel(
        "token (only the positions the routes touch, in order)" if compress else "token position"
    )
    ax.grid(axis="y", alpha=0.25)
    handles = [
        Line2D([], [], color=POSITIVE, lw=2.5, label="through a head, carries the flow"),
        Line2D([], [], color=NEGATIVE, lw=2.5, label="through a head, opposes it"),
        Line2D([], [], color="#555555", lw=2.5, ls=(0, (3, 1.5)), label="residual stream"),
        Line2D([], [], color="#f59e0b", marker="*", ms=11, mec="black", ls="", label="target"),
    ]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(
        f"{result.model}: routes into position {routes.position}'s final state\n"
        f"(target {k}: {result.describe_target(k)})\n"
        f"{len(routes.edges)} edges with |weight| ≥ {routes.threshold:.3g}; "
        f"width ∝ |weight| (widest {biggest:.3g})",
        fontsize=9,
    )
    _quiet_layout(fig)
    return _finish(fig, path)


register_figure(Attribution, attribution_figure)
