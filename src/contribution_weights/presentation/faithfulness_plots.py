"""Figures of the faithfulness experiments (paper Figures 3 and 4), drawn from summaries.

Inputs are the summary DataFrames the experiments write (``summary.csv``), never models.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from ..experiments.downstream import DownstreamResult
from ..experiments.faithfulness import FaithfulnessResult
from .figures import finish, measure_style, register_figure

LOG_RANGE = 20.0  # use a log y axis when the positive values span more than this factor


def wants_log_scale(values: np.ndarray) -> bool:
    """True when all values are positive and span more than :data:`LOG_RANGE`."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    return bool(v.size and (v > 0).all() and v.max() / v.min() > LOG_RANGE)


def _dodge(rates: np.ndarray, i: int, count: int) -> float:
    """A small horizontal offset for line ``i`` of ``count``, so error bars at the same rate
    do not hide each other (about 1% of the rate span apart)."""
    rates = np.unique(rates[np.isfinite(rates)])
    span = float(rates.max() - rates.min()) if rates.size > 1 else 0.1
    return (i - (count - 1) / 2) * 0.012 * span


def _rate_axis(ax: Any, rates: np.ndarray) -> None:
    """Ticks at the rates that were run, with a margin on either side."""
    rates = np.unique(rates[np.isfinite(rates)])
    ax.set_xticks(rates, [f"{r:g}" for r in rates])
    span = float(rates.max() - rates.min()) if rates.size > 1 else 0.0
    pad = 0.08 * span if span > 0 else 0.05
    ax.set_xlim(float(rates.min()) - pad, float(rates.max()) + pad)
    ax.set_xlabel("removal rate p")


def _by_measure(
    ax: Any, part: pd.DataFrame, value: str, se: np.ndarray | None, rate: float
) -> None:
    """One rate: a point per measure (categorical x), with its error bar."""
    names = [str(m) for m in part["measure"]]
    for i, name in enumerate(names):
        color, marker = measure_style(name, i)
        y = float(part[value].iloc[i])
        err = None if se is None else (se[:, i : i + 1] if se.ndim == 2 else [[se[i]], [se[i]]])
        ax.errorbar([i], [y], yerr=err, fmt=marker, color=color, capsize=4, ms=7, label=name)
    ax.set_xticks(range(len(names)), names)
    ax.set_xlim(-0.6, len(names) - 0.4)
    ax.set_xlabel(f"measure (removal rate p = {rate:g})")


def plot_faithfulness(
    summary: pd.DataFrame, path: str | Path | None = None, title: str | None = None
) -> Any:
    """ΔPPL against removal rate: a panel per mode, one line per measure (nudged sideways a
    little so that error bars stay apart), error bars ±1 standard error over sequences
    (``delta_ppl_se``). With a single rate each panel shows
    one point per measure instead of a line."""
    modes = list(dict.fromkeys(summary["mode"]))
    rates = summary["rate"].to_numpy(float)
    single = np.unique(rates).size == 1
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 3.8), squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        part = summary[summary["mode"] == mode]
        if single:
            se = part["delta_ppl_se"].fillna(0).to_numpy(float)
            _by_measure(ax, part, "delta_ppl_mean", se, float(rates[0]))
        else:
            groups = list(part.groupby("measure", sort=False))
            for i, (measure, g) in enumerate(groups):
                g = g.sort_values("rate")
                color, marker = measure_style(str(measure), i)
                shift = _dodge(part["rate"].to_numpy(float), i, len(groups))
                ax.errorbar(
                    g["rate"].to_numpy(float) + shift,
                    g["delta_ppl_mean"].to_numpy(float),
                    yerr=g["delta_ppl_se"].fillna(0).to_numpy(float),
                    marker=marker,
                    color=color,
                    capsize=3,
                    label=str(measure),
                )
            _rate_axis(ax, part["rate"].to_numpy(float))
        if wants_log_scale(part["delta_ppl_mean"].to_numpy(float)):
            ax.set_yscale("log")
        better = (
            "higher is more faithful" if mode == "comprehensiveness" else "lower is more faithful"
        )
        ax.set_title(f"{mode} ({better})", fontsize=10)
        ax.set_ylabel("ΔPPL (mean ± 1 s.e.)")
        ax.grid(alpha=0.3)
        if not single:  # one rate: the measures are already the x axis
            ax.legend(fontsize=8)
    return finish(fig, path, title)


RUN_STYLES: tuple[Literal["-", "--", ":", "-."], ...] = ("-", "--", ":", "-.")


def plot_faithfulness_runs(
    runs: Mapping[str, pd.DataFrame],
    path: str | Path | None = None,
    title: str | None = None,
    value: str = "delta_ppl",
) -> Any:
    """Several faithfulness runs on shared axes (e.g. layer scope against global scope, or
    sinks protected against not): a panel per mode, a colour per measure, a line style per
    run (``runs`` maps a label to a run's summary), error bars ±1 s.e. ``value`` is
    ``"delta_ppl"`` or ``"delta_nll"``; a log axis where the values span decades."""
    if not runs:
        raise ValueError("no runs to plot; pass {label: summary DataFrame}")
    if len(runs) > len(RUN_STYLES):
        raise ValueError(f"at most {len(RUN_STYLES)} runs fit one figure, got {len(runs)}")
    frames = list(runs.values())
    modes = list(dict.fromkeys(m for f in frames for m in f["mode"]))
    measures = list(dict.fromkeys(m for f in frames for m in f["measure"]))
    fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes), 4.2), squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        shown = []
        for k, frame in enumerate(frames):
            part = frame[frame["mode"] == mode]
            for i, measure in enumerate(measures):
                g = part[part["measure"] == measure].sort_values("rate")
                if g.empty:
                    continue
                color, marker = measure_style(str(measure), i)
                slot = k * len(measures) + i
                shift = _dodge(g["rate"].to_numpy(float), slot, len(runs) * len(measures))
                ax.errorbar(
                    g["rate"].to_numpy(float) + shift,
                    g[f"{value}_mean"].to_numpy(float),
                    yerr=g[f"{value}_se"].fillna(0).to_numpy(float),
                    marker=marker, color=color, linestyle=RUN_STYLES[k], capsize=2, ms=4,
                )  # fmt: skip
                shown.append(g[f"{value}_mean"].to_numpy(float))
        rates = np.concatenate([f["rate"].to_numpy(float) for f in frames])
        _rate_axis(ax, rates)
        if shown and wants_log_scale(np.concatenate(shown)):
            ax.set_yscale("log")
        better = "higher" if mode == "comprehensiveness" else "lower"
        ax.set_title(f"{mode} ({better} is more faithful)", fontsize=10)
        name = "ΔPPL" if value == "delta_ppl" else "ΔNLL"
        ax.set_ylabel(f"{name} (mean ± 1 s.e.)")
        ax.grid(alpha=0.3)
    handles = [
        plt.Line2D([], [], color=c, marker=mk, label=str(m))
        for i, m in enumerate(measures)
        for c, mk in [measure_style(str(m), i)]
    ] + [
        plt.Line2D([], [], color="black", linestyle=RUN_STYLES[k], label=label)
        for k, label in enumerate(runs)
    ]
    axes[0][0].legend(handles=handles, fontsize=8)
    return finish(fig, path, title)


def _accuracy_error(part: pd.DataFrame) -> np.ndarray:
    """``(2, n)`` distances below and above each accuracy: its Wilson interval when the
    summary has one, else ±1 binomial standard error."""
    acc = part["accuracy"].to_numpy(float)
    if "accuracy_lo" in part:
        lo, hi = part["accuracy_lo"].to_numpy(float), part["accuracy_hi"].to_numpy(float)
        return np.clip(np.stack([acc - lo, hi - acc]), 0, None)
    se = binomial_se(acc, part["n"].to_numpy(float))
    return np.stack([se, se])


def binomial_se(accuracy: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Standard error of an accuracy over ``n`` items, √(a(1−a)/n)."""
    a = np.asarray(accuracy, dtype=float)
    return np.sqrt(np.clip(a * (1 - a), 0, None) / np.maximum(np.asarray(n, dtype=float), 1))


def plot_downstream(
    summary: pd.DataFrame, path: str | Path | None = None, title: str | None = None
) -> Any:
    """Accuracy against sufficiency removal rate: a panel per task, clean accuracy dashed
    (its 95% interval shaded), chance dotted, error bars the 95% Wilson interval (summaries
    without one: ±1 binomial standard error √(a(1−a)/n)). With a single rate each panel
    shows one point per measure."""
    tasks = list(dict.fromkeys(summary["task"]))
    single = summary["rate"].nunique() == 1
    wilson = "accuracy_lo" in summary
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.8), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        part = summary[summary["task"] == task]
        if single:
            _by_measure(ax, part, "accuracy", _accuracy_error(part), float(part["rate"].iloc[0]))
        else:
            groups = list(part.groupby("measure", sort=False))
            for i, (measure, g) in enumerate(groups):
                g = g.sort_values("rate")
                color, marker = measure_style(str(measure), i)
                acc = g["accuracy"].to_numpy(float)
                shift = _dodge(part["rate"].to_numpy(float), i, len(groups))
                ax.errorbar(
                    g["rate"].to_numpy(float) + shift,
                    acc,
                    yerr=_accuracy_error(g),
                    marker=marker,
                    color=color,
                    capsize=3,
                    label=str(measure),
                )
            _rate_axis(ax, part["rate"].to_numpy(float))
        clean = float(part["clean_accuracy"].iloc[0])
        ax.axhline(clean, color="black", linestyle="--", linewidth=1, label="clean")
        if wilson:
            lo, hi = float(part["clean_lo"].iloc[0]), float(part["clean_hi"].iloc[0])
            ax.axhspan(lo, hi, color="black", alpha=0.08, linewidth=0)
        chance = float(part["chance"].iloc[0]) if "chance" in part else float("nan")
        if np.isfinite(chance):
            ax.axhline(chance, color="grey", linestyle=":", linewidth=1, label="chance")
        n = int(part["n"].iloc[0])
        ax.set_title(f"{task} (n={n}, sufficiency)", fontsize=10)
        ax.set_ylabel("accuracy (95% CI)" if wilson else "accuracy (± 1 s.e.)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return finish(fig, path, title)


def faithfulness_figure(result: FaithfulnessResult, path: str | Path | None = None) -> Any:
    """ΔPPL against rate, one line per measure, a panel per mode (matplotlib Figure)."""
    c = result.config
    n = int(result.summary["n"].max()) if not result.summary.empty else 0
    source = c.get("source") or "texts"
    title = f"{c.get('model')} · {source} · n={n} · ≤{c.get('max_tokens')} tokens"
    return plot_faithfulness(result.summary, path=path, title=title)


def downstream_figure(result: DownstreamResult, path: str | Path | None = None) -> Any:
    """Accuracy against the share of prompt tokens kept, a line per measure."""
    return plot_downstream(result.summary, path=path)


register_figure(FaithfulnessResult, faithfulness_figure)
register_figure(DownstreamResult, downstream_figure)
