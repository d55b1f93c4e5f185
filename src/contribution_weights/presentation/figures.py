"""Figures of a single trace: heatmaps side by side (paper Fig. 1) and first-token weight.

Everything here reads a :class:`~contribution_weights.results.Trace`; nothing touches a
model. Functions return the matplotlib Figure; :func:`save` writes it as a PNG.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure

from ..measures.registry import get_measure
from ..results import Trace

FIRST_TOKEN_MEASURES = ("attention", "vw", "contribution")
_MAX_TICK_LABELS = 48


def save(fig: Figure, path: str | Path, dpi: int = 130) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return path


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
            first = {m: trace.reduced(m).first[pos].mean(-1) for m in ("attention", "contribution")}
            head = int((first["attention"] - first["contribution"]).argmax())
        pairs.append((trace.layers[pos], head))
    return pairs


def _labels(tokens: Sequence[str]) -> list[str]:
    return [t.replace("\n", "\\n") if t.strip() else repr(t)[1:-1] or "·" for t in tokens]


def plot_heatmaps(
    trace: Trace,
    pairs: Sequence[tuple[int, int]] | None = None,
    measures: Sequence[str] = ("attention", "contribution"),
) -> Figure:
    """One row per (layer, head), one column per measure (paper Figure 1).

    Signed measures use a diverging scale centred on 0 (blue: opposes the output).
    """
    measures = [m for m in measures if m in trace] or list(trace.measures)[:2]
    pairs = list(pairs) if pairs else sink_heads(trace)
    t = trace.num_tokens
    size = min(5.0, 2.5 + t / 20)
    fig, axes = plt.subplots(
        len(pairs),
        len(measures),
        figsize=(size * len(measures) + 1, size * len(pairs)),
        squeeze=False,
    )
    labels = _labels(trace.tokens)
    mask = torch.ones(t, t, dtype=torch.bool).triu(1)
    for r, (layer, head) in enumerate(pairs):
        pos = trace.layer_position(layer)
        if not 0 <= head < trace.num_heads:
            raise ValueError(f"head {head} out of range: the model has {trace.num_heads} heads")
        for c, name in enumerate(measures):
            ax = axes[r][c]
            w = trace[name][pos, head].clone().float()
            w[mask] = float("nan")
            if get_measure(name).signed:
                vmax = float(w.nan_to_num(0).abs().max()) or 1.0
                im = ax.imshow(w, cmap="RdBu_r", vmin=-vmax, vmax=vmax)
            else:
                im = ax.imshow(w, cmap="viridis", vmin=0)
            ax.set_title(f"{name} — layer {layer}, head {head}", fontsize=9)
            ax.set_xlabel("key")
            ax.set_ylabel("query")
            if t <= _MAX_TICK_LABELS:
                ax.set_xticks(range(t), labels, rotation=90, fontsize=6)
                ax.set_yticks(range(t), labels, fontsize=6)
            fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02)
    fig.suptitle(f"{trace.model_name}: attention vs contribution", fontsize=11)
    fig.tight_layout()
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
    for name in names:
        values = trace.first_token_weight(name)
        ax.plot(trace.layers, values, marker="o", ms=3, label=f"{name} (mean {values.mean():.3f})")
    ax.set_xlabel("layer")
    ax.set_ylabel("weight on token 0")
    ax.set_ylim(bottom=min(0.0, ax.get_ylim()[0]))
    ax.set_title(f"{trace.model_name}: first-token weight by layer ({trace.num_tokens} tokens)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
