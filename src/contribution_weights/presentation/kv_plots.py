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

OURS = ("contribution", "contribution_sinks")
LABEL = {"nll": "NLL of the next 128 tokens (lower is better)", "accuracy": "passkey accuracy"}


def plot_kv(
    summary: pd.DataFrame, metric: str, path: str | Path | None = None, title: str | None = None
) -> Any:
    """``metric`` against ratio (± 1 s.e. error bars); contribution methods drawn bold."""
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    base = summary[summary["method"] == "none"]
    methods = [m for m in dict.fromkeys(summary["method"]) if m != "none"]
    for i, method in enumerate(methods):
        g = pd.concat([base, summary[summary["method"] == method]]).sort_values("ratio")
        ours = method in OURS
        ax.errorbar(
            g["ratio"].to_numpy(float),
            g[f"{metric}_mean"].to_numpy(float),
            yerr=g[f"{metric}_se"].fillna(0).to_numpy(float),
            label=method,
            color="tab:red" if method == "contribution_sinks" else (
                "darkred" if method == "contribution" else f"C{i % 10}"),
            linewidth=2.4 if ours else 1.2,
            linestyle="-" if ours else "--",
            marker="o" if ours else ".",
            capsize=2,
        )  # fmt: skip
    ax.set_xlabel("compression ratio (fraction of cache entries evicted)")
    ax.set_ylabel(LABEL.get(metric, metric))
    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, frameon=False)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=130)
        plt.close(fig)
    return fig
