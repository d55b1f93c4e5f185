"""Figures of the faithfulness experiments (paper Figures 3 and 4), drawn from summaries.

Inputs are the summary DataFrames the experiments write (``summary.csv``), never models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

MEASURE_STYLE = {
    "attention": ("tab:blue", "o"),
    "vw": ("tab:orange", "s"),
    "vw_on": ("tab:green", "^"),
    "ihc": ("tab:red", "D"),
    "distance": ("tab:purple", "v"),
}
LOG_RANGE = 20.0  # use a log y axis when the positive values span more than this factor


def _style(measure: str, i: int) -> tuple[str, str]:
    return MEASURE_STYLE.get(measure, (f"C{(i + 5) % 10}", "x"))


def wants_log_scale(values: np.ndarray) -> bool:
    """True when all values are positive and span more than :data:`LOG_RANGE`."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    return bool(v.size and (v > 0).all() and v.max() / v.min() > LOG_RANGE)


def plot_faithfulness(
    summary: pd.DataFrame, path: str | Path | None = None, title: str | None = None
) -> Any:
    """ΔPPL against removal rate: a panel per mode, one line per measure (± 1 s.e.)."""
    modes = list(dict.fromkeys(summary["mode"]))
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 3.8), squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        part = summary[summary["mode"] == mode]
        for i, (measure, g) in enumerate(part.groupby("measure", sort=False)):
            g = g.sort_values("rate")
            color, marker = _style(str(measure), i)
            se = g["delta_ppl_se"].fillna(0).to_numpy(float)
            y = g["delta_ppl_mean"].to_numpy(float)
            x = g["rate"].to_numpy(float)
            ax.plot(x, y, marker=marker, color=color, label=str(measure))
            ax.fill_between(x, y - se, y + se, color=color, alpha=0.15, linewidth=0)
        if wants_log_scale(part["delta_ppl_mean"].to_numpy(float)):
            ax.set_yscale("log")
        better = (
            "higher is more faithful" if mode == "comprehensiveness" else "lower is more faithful"
        )
        ax.set_title(f"{mode} ({better})", fontsize=10)
        ax.set_xlabel("removal rate p")
        ax.set_ylabel("ΔPPL")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return fig


def plot_downstream(
    summary: pd.DataFrame, path: str | Path | None = None, title: str | None = None
) -> Any:
    """Accuracy against sufficiency removal rate: a panel per task, clean accuracy dashed."""
    tasks = list(dict.fromkeys(summary["task"]))
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.8), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        part = summary[summary["task"] == task]
        for i, (measure, g) in enumerate(part.groupby("measure", sort=False)):
            g = g.sort_values("rate")
            color, marker = _style(str(measure), i)
            ax.plot(g["rate"], g["accuracy"], marker=marker, color=color, label=str(measure))
        clean = float(part["clean_accuracy"].iloc[0])
        ax.axhline(clean, color="black", linestyle="--", linewidth=1, label="clean")
        n = int(part["n"].iloc[0])
        ax.set_title(f"{task} (n={n}, sufficiency)", fontsize=10)
        ax.set_xlabel("removal rate p")
        ax.set_ylabel("accuracy")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return fig
