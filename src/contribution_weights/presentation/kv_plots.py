"""Figures of ``cw kv-eval``: the task's metric against compression ratio, a line per method.

Inputs are the summary DataFrames the experiment writes (``summary.csv``), never models.
The ratio-0 point (no compression, method ``none``) starts every method's line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from .faithfulness_plots import finish

OURS = ("contribution", "contribution_sinks")
LABEL = {"nll": "NLL of the next 128 tokens (lower is better)", "accuracy": "passkey accuracy"}


def plot_kv(
    summary: pd.DataFrame,
    metric: str,
    path: str | Path | None = None,
    title: str | None = None,
    paired: pd.DataFrame | None = None,
) -> Any:
    """``metric`` against ratio (± 1 s.e. error bars); contribution methods drawn bold.

    ``paired`` (columns method, ratio, delta_mean, delta_se: each item's difference from
    its own uncompressed score, see ``KVEvalResult.paired``) adds a second panel on a
    symmetric-log axis: the raw means overlap within their error bars, which are mostly
    how hard each text is, while the paired differences separate the methods.
    """
    panels = 2 if paired is not None else 1
    fig, axes = plt.subplots(1, panels, figsize=(7.5 * panels, 4.5), squeeze=False)
    ax = axes[0, 0]
    _lines(ax, summary, f"{metric}_mean", f"{metric}_se")
    ax.set_ylabel(LABEL.get(metric, metric))
    if paired is not None:
        right = axes[0, 1]
        _lines(right, paired, "delta_mean", "delta_se")
        right.set_yscale("symlog", linthresh=0.01)
        right.axhline(0, color="black", linewidth=0.6)
        right.set_ylabel(f"Δ{metric.upper() if metric == 'nll' else metric} against no "
                         "compression, paired (symlog)")  # fmt: skip
    for a in axes[0]:
        a.set_xlabel("compression ratio (fraction of cache entries evicted)")
        a.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, frameon=False)
    return finish(fig, path, title, dpi=130, fontsize=10)


def _lines(ax: Any, frame: pd.DataFrame, mean: str, se: str) -> None:
    """A line per method from the ratio-0 point (method ``none``) on."""
    base = frame[frame["method"] == "none"]
    methods = [m for m in dict.fromkeys(frame["method"]) if m != "none"]
    for i, method in enumerate(methods):
        g = pd.concat([base, frame[frame["method"] == method]]).sort_values("ratio")
        ours = method in OURS
        ax.errorbar(
            g["ratio"].to_numpy(float),
            g[mean].to_numpy(float),
            yerr=g[se].fillna(0).to_numpy(float),
            label=method,
            color="tab:red" if method == "contribution_sinks" else (
                "darkred" if method == "contribution" else f"C{i % 10}"),
            linewidth=2.4 if ours else 1.2,
            linestyle="-" if ours else "--",
            marker="o" if ours else ".",
            capsize=2,
        )  # fmt: skip
