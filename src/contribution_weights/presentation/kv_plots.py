"""Figures of ``cw kv-eval``: the task's metric against compression ratio, a line per method,
with the paired differences (language modelling) or the accuracy per needle depth (passkey)
beside it; for the RULER-like suite a panel per task and setting.

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

from ..experiments.kv_eval import METRIC, KVEvalResult
from .figures import finish, register_figure

OURS = ("contribution", "contribution_sinks")
LABEL = {"nll": "NLL of the next 128 tokens (lower is better)", "accuracy": "passkey accuracy"}


def plot_kv(
    summary: pd.DataFrame,
    metric: str,
    path: str | Path | None = None,
    title: str | None = None,
    paired: pd.DataFrame | None = None,
    by_depth: pd.DataFrame | None = None,
    depth_ratio: float | None = None,
) -> Any:
    """``metric`` against ratio (± 1 s.e. error bars); contribution methods drawn bold.

    ``paired`` (columns method, ratio, delta_mean, delta_se: each item's difference from
    its own uncompressed score, see ``KVEvalResult.paired``) adds a second panel on a
    symmetric-log axis: the raw means overlap within their error bars, which are mostly
    how hard each text is, while the paired differences separate the methods.

    ``by_depth`` (the passkey summary per needle depth, ``KVEvalResult.by_depth``) adds a
    panel of accuracy against the needle's depth at ``depth_ratio``, with the uncompressed
    model's accuracy in black: which part of the context each method forgets.
    """
    extra = [f for f in (paired, by_depth) if f is not None]
    panels = 1 + len(extra)
    fig, axes = plt.subplots(1, panels, figsize=(7.5 * panels, 4.5), squeeze=False)
    ax = axes[0, 0]
    _lines(ax, summary, f"{metric}_mean", f"{metric}_se")
    ax.set_ylabel(LABEL.get(metric, metric))
    for a in axes[0]:
        a.set_xlabel("compression ratio (fraction of cache entries evicted)")
        a.grid(alpha=0.3)
    if paired is not None:
        right = axes[0, 1]
        _lines(right, paired, "delta_mean", "delta_se")
        right.set_yscale("symlog", linthresh=0.01)
        right.axhline(0, color="black", linewidth=0.6)
        right.set_ylabel(f"Δ{metric.upper() if metric == 'nll' else metric} against no "
                         "compression, paired (symlog)")  # fmt: skip
    if by_depth is not None:
        if depth_ratio is None:
            raise ValueError("by_depth needs depth_ratio: the compression ratio to show")
        right = axes[0, -1]
        at = by_depth[by_depth["ratio"].isin([0.0, depth_ratio])]
        _lines(right, at, f"{metric}_mean", f"{metric}_se", x="depth")
        right.set_xlabel("needle depth (fraction of the context before it)")
        right.set_ylabel(f"{LABEL.get(metric, metric)} at ratio {depth_ratio:g}")
        none = [c for c in right.containers if c.get_label() == "no compression"]
        right.legend(handles=none, fontsize=7, frameon=False)  # the methods: left legend
    ax.legend(fontsize=7, ncol=2, frameon=False)
    return finish(fig, path, title, dpi=130, fontsize=10)


def plot_ruler(
    summary: pd.DataFrame, path: str | Path | None = None, title: str | None = None
) -> Any:
    """RULER-like accuracy against ratio: a panel per task (columns) and setting (rows), a
    line per method (± 1 s.e.) starting at the uncompressed accuracy (ratio 0, method
    ``none``), which a dotted black line carries across the panel: compressing cannot be
    expected to do better than the model does on the whole context, and a task whose
    line sits near 0 is one the model cannot do."""
    tasks = list(dict.fromkeys(summary["task"]))
    settings = list(dict.fromkeys(summary["setting"]))
    methods = [m for m in dict.fromkeys(summary["method"]) if m != "none"]
    if not tasks:
        raise ValueError("the summary has no rows to plot")
    fig, grid = plt.subplots(
        len(settings), len(tasks) + 1, figsize=(4.0 * len(tasks) + 2.2, 3.4 * len(settings)),
        squeeze=False, gridspec_kw={"width_ratios": [1.0] * len(tasks) + [0.55]},
    )  # fmt: skip
    axes = grid[:, :-1]
    for r, setting in enumerate(settings):
        for c, task in enumerate(tasks):
            ax = axes[r, c]
            cell = summary[(summary["task"] == task) & (summary["setting"] == setting)]
            _lines(ax, cell, "accuracy_mean", "accuracy_se", order=methods)
            base = cell.loc[cell["method"] == "none", "accuracy_mean"]
            if not base.empty:
                ax.axhline(float(base.iloc[0]), color="black", linewidth=0.9, linestyle=":")
            n = int(cell["n"].max()) if not cell.empty else 0
            ax.set_title(f"{task} · {setting.replace('_', '-')} · n={n}", fontsize=9)
            ax.set_ylim(-0.05, 1.05)
            ax.grid(alpha=0.3)
            if r == len(settings) - 1:
                ax.set_xlabel("compression ratio")
            if c == 0:
                ax.set_ylabel("accuracy (string match)")
    for ax in grid[:, -1]:
        ax.axis("off")
    legend: dict[str, Any] = {}  # every method once, whichever panel drew it
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)
    grid[0, -1].legend(list(legend.values()), list(legend), loc="upper left", fontsize=7,
                       frameon=False)  # fmt: skip
    return finish(fig, path, title, dpi=130, fontsize=10)


def _colour(i: int, count: int) -> Any:
    """The ``i``-th of ``count`` method colours: matplotlib's cycle, or tab20 beyond ten."""
    return f"C{i % 10}" if count <= 10 else plt.get_cmap("tab20")(i % 20)


def _lines(
    ax: Any,
    frame: pd.DataFrame,
    mean: str,
    se: str,
    x: str = "ratio",
    order: list[str] | None = None,
) -> None:
    """A line per method against ``x``. Against ratio every line starts at the ratio-0
    point (method ``none``); against anything else ``none`` is a line of its own, in black.
    ``order`` (every method of the figure) keeps a method's colour the same in every panel."""
    base = frame[frame["method"] == "none"]
    methods = [m for m in dict.fromkeys(frame["method"]) if m != "none"]
    order = order or methods
    if x != "ratio" and not base.empty:
        g = base.sort_values(x)
        ax.errorbar(g[x].to_numpy(float), g[mean].to_numpy(float),
                    yerr=g[se].fillna(0).to_numpy(float), label="no compression",
                    color="black", linewidth=1.6, marker="s", capsize=2)  # fmt: skip
    for method in methods:
        i = order.index(method)
        g = frame[frame["method"] == method]
        g = (pd.concat([base, g]) if x == "ratio" else g).sort_values(x)
        ours = method in OURS
        ax.errorbar(
            g[x].to_numpy(float),
            g[mean].to_numpy(float),
            yerr=g[se].fillna(0).to_numpy(float),
            label=method,
            color="tab:red" if method == "contribution_sinks" else (
                "darkred" if method == "contribution" else _colour(i, len(order))),
            linewidth=2.4 if ours else 1.2,
            linestyle="-" if ours else "--",
            marker="o" if ours else ".",
            capsize=2,
        )  # fmt: skip


def kv_eval_figure(result: KVEvalResult, path: str | Path | None = None) -> Any:
    """The figure of a kv-eval result: the metric against ratio, with the paired
    differences (language modelling), the accuracy per needle depth (passkey) or a panel
    per task and setting (ruler)."""
    c = result.config
    summary = result.summary
    n = int(summary["n"].max()) if not summary.empty else 0
    title = f"{c['model']} · {c['source']} · C={c['context_tokens']} · n={n}"
    metric = METRIC[c["task"]]
    if c["task"] == "ruler":
        return plot_ruler(summary, path=path, title=f"{c['model']} · C={c['context_tokens']}")
    if c["task"] != "passkey":
        return plot_kv(summary, metric, path=path, title=title, paired=result.paired())
    ratios = sorted(r for r in summary["ratio"].unique() if r > 0)
    depth_ratio = (0.5 if 0.5 in ratios else ratios[0]) if ratios else None
    return plot_kv(
        summary,
        metric,
        path=path,
        title=title,
        by_depth=result.by_depth() if depth_ratio is not None else None,
        depth_ratio=depth_ratio,
    )


register_figure(KVEvalResult, kv_eval_figure)
