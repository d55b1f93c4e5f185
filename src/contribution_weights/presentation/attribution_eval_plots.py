"""The figure of ``cw attribution-eval``: deletion and insertion curves per intervention,
a line per ranking (methods and baselines), and the known-answer hit rates.

Inputs are the result's tables (``curves.csv``, the hits in ``rows.csv``), never models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from ..experiments.attribution_eval import MODES, REFERENCE, AttributionEvalResult
from .figures import finish, register_figure

#: what each mode's y axis means, and which way is better
YLABEL = {
    "comprehensiveness": "Δ log P, top removed (higher is better)",
    "sufficiency": "Δ log P, bottom removed (lower is better)",
    "insertion": "Δ log P, only top kept (lower is better)",
}
BASELINE_STYLE = {"random": ("grey", ":"), "recency": ("black", "--")}


def _style(name: str, i: int) -> tuple[str, str, float]:
    if name in BASELINE_STYLE:
        colour, dash = BASELINE_STYLE[name]
        return colour, dash, 1.2
    return f"C{i % 10}", "-", 2.6 if name == REFERENCE else 1.4


def attribution_eval_figure(result: AttributionEvalResult, path: str | Path | None = None) -> Any:
    """One row per intervention, one panel per mode (mean delta ± 1 s.e. against the
    rate), and, for known-answer tasks, a panel of top-1 and top-5 hit rates."""
    table = result.curve_table()
    interventions = list(dict.fromkeys(table["intervention"])) or ["key_mask"]
    hits = result.hits.dropna(subset=["hit1"])
    columns = len(MODES) + (1 if not hits.empty else 0)
    fig, axes = plt.subplots(
        len(interventions), columns, figsize=(4.6 * columns, 3.6 * len(interventions)),
        squeeze=False,
    )  # fmt: skip
    rankings = list(dict.fromkeys(table["measure"]))
    for row, how in enumerate(interventions):
        for col, mode in enumerate(MODES):
            ax = axes[row, col]
            part = table[(table["intervention"] == how) & (table["mode"] == mode)]
            for i, name in enumerate(rankings):
                line = part[part["measure"] == name].sort_values("rate")
                if line.empty:
                    continue
                colour, dash, width = _style(name, i)
                ax.errorbar(
                    line["rate"], line["mean"], yerr=line["se"], color=colour, linestyle=dash,
                    linewidth=width, marker="o", markersize=3, capsize=2, label=name,
                )  # fmt: skip
            ax.set_title(f"{mode} ({how})", fontsize=10)
            ax.set_xlabel("share of candidate tokens")
            ax.set_ylabel(YLABEL[mode], fontsize=8)
            ax.grid(alpha=0.3)
        if not hits.empty:
            ax = axes[row, -1]
            if row == 0:
                # the summary's rates: the random seeds pooled per item into one bar
                agg = result.summary.dropna(subset=["top1"]).set_index("measure")
                xs = range(len(agg))
                ax.bar([x - 0.2 for x in xs], agg["top1"], width=0.4, label="top-1")
                ax.bar([x + 0.2 for x in xs], agg["top5"], width=0.4, label="top-5")
                ax.set_xticks(list(xs), list(agg.index), rotation=35, ha="right", fontsize=8)
                ax.set_ylim(0, 1)
                ax.set_ylabel("source token found")
                ax.set_title(f"known answer (n = {hits['item'].nunique()})", fontsize=10)
                ax.legend(fontsize=8)
            else:
                ax.axis("off")
    axes[0, 0].legend(fontsize=7)
    config = result.config
    title = (
        f"attribution-eval: {config.get('task', '?')} on {config.get('model', '?')}, "
        f"{result.rows['item'].nunique() if not result.rows.empty else 0} items of "
        f"{config.get('tokens', '?')} tokens"
    )
    return finish(fig, path, title)


register_figure(AttributionEvalResult, attribution_eval_figure)
