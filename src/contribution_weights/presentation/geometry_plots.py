"""Figures and Markdown tables of a :class:`~..experiments.geometry.GeometryResult`.

One function per figure, each returning a matplotlib Figure (Agg backend):
first-token weight per layer (Table 4), sink/tail alignment (Fig. 5), sink-value scaling
(Fig. 6c), output norm against sink attention with the fitted curves (§6.2), the
semantic cone with and without the sink (Fig. 6a/b), joint distributions (Fig. 7).

Each analysis' figure is registered here by the analysis' name
(:func:`register_geometry_figure`): ``draw(table, title) -> Figure | None``, given the
analysis' table (``result.tables[name]``; None: nothing to draw). An analysis defined
elsewhere registers its figure the same way. :func:`write_figures` saves the figure of
every analysis of a result that has one; :func:`markdown_tables` joins the analyses'
Markdown sections.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from ..experiments.geometry import GeometryResult
from ..registry import Registry
from .figures import measure_style, save


def plot_first_token_weight(by_layer: pd.DataFrame, title: str = "") -> Figure:
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for i, m in enumerate(by_layer.columns):
        colour, _ = measure_style(m, i)
        ax.plot(by_layer.index, by_layer[m], marker=".", label=m, color=colour)
    ax.set(xlabel="layer", ylabel="first-token weight E[w_0]", title=f"First-token weight {title}")
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def plot_sink_alignment(
    table: pd.DataFrame, title: str = "", null: pd.DataFrame | None = None
) -> Figure:
    """The per-layer cosines; with ``null`` (its rows by layer), the permutation null of
    cos(ṽ_0, ṽ_j) (a random token in place of the sink) as its mean ± sd."""
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(table.index, table["sink_tail"], marker=".", label="cos(ṽ_0, ṽ_j), j ≥ 1")
    ax.plot(table.index, table["tail_tail"], marker=".", label="cos(ṽ_i, ṽ_j), i ≠ j ≥ 1")
    if null is not None:
        rows = null.loc[[i for i in null.index if i != "mean"]]
        layers = np.asarray(rows.index, dtype=float)
        mean, sd = rows["null_mean"].to_numpy(float), rows["null_sd"].to_numpy(float)
        ax.plot(layers, mean, color="grey", ls="--", lw=1, label="null: random token c (± sd)")
        ax.fill_between(layers, mean - sd, mean + sd, color="grey", alpha=0.2, lw=0)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set(xlabel="layer", ylabel="mean cosine", title=f"Sink / tail alignment {title}")
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def plot_sink_scaling(
    table: pd.DataFrame,
    layers: list[int],
    title: str = "",
    control: pd.DataFrame | None = None,
) -> Figure:
    """Perplexity against γ with v_0 scaled; with ``control``, the same with a random
    non-sink token's value scaled instead."""
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.errorbar(
        table["gamma"], table["ppl_mean"], yerr=table["ppl_se"].fillna(0), marker="o",
        capsize=3, label="sink: v_0 → γ v_0",
    )  # fmt: skip
    if control is not None:
        ax.errorbar(
            control["gamma"], control["ppl_mean"], yerr=control["ppl_se"].fillna(0),
            marker="s", capsize=3, color="grey", ls="--", label="control: v_c → γ v_c",
        )  # fmt: skip
        ax.legend(fontsize=8)
    ax.invert_xaxis()
    span = f"layers {layers[0]}–{layers[-1]} ({len(layers)})" if layers else "no sink layers"
    xlabel = "γ (v_0 → γ v_0)" if control is None else "γ"
    ax.set(xlabel=xlabel, ylabel="perplexity", title=f"Sink-value scaling {title}\n{span}")
    ax.grid(alpha=0.3)
    return fig


def example_heads(
    fit: pd.DataFrame, points: dict[tuple[int, int], np.ndarray], count: int = 4
) -> list[tuple[int, int]]:
    """Heads to draw: well-fitting heads whose sampled α_i0 spread over [0, 1], those with
    an interior minimum (convex, 0 < α_min < 1) first."""
    spread = {k: float(np.std(v[:, 0])) for k, v in points.items() if len(v)}
    ranked = fit.assign(
        spread=[spread.get((int(r.layer), int(r.head)), 0.0) for r in fit.itertuples()]
    )
    ranked = ranked[ranked["spread"] >= 0.1] if (ranked["spread"] >= 0.1).any() else ranked
    ranked = ranked.sort_values(["convex_min_below_1", "r2"], ascending=False)
    return [(int(r.layer), int(r.head)) for r in ranked.head(count).itertuples()]


def plot_norm_fit(
    fit: pd.DataFrame, points: dict[tuple[int, int], np.ndarray], title: str = ""
) -> Figure:
    heads = [h for h in example_heads(fit, points) if h in points]
    fig, axes = plt.subplots(
        1, max(1, len(heads)), figsize=(3.2 * max(1, len(heads)), 3), squeeze=False
    )
    grid = np.linspace(0, 1, 101)
    for ax, (layer, head) in zip(axes[0], heads, strict=False):
        row = fit[(fit["layer"] == layer) & (fit["head"] == head)].iloc[0]
        pts = points[(layer, head)]
        ax.scatter(pts[:, 0], np.sqrt(np.clip(pts[:, 1], 0, None)), s=4, alpha=0.5)
        curve = (
            row.v0_norm2 * grid**2
            + 2 * grid * (1 - grid) * row.gamma_prime
            + (1 - grid) ** 2 * row.kappa2
        )
        ax.plot(grid, np.sqrt(np.clip(curve, 0, None)), color="k", lw=1.2)
        if 0 < row.alpha_min < 1:
            ax.axvline(row.alpha_min, color="tab:red", ls="--", lw=0.8)
        ax.set(
            xlabel="α_i0",
            title=f"L{layer} H{head}: γ'={row.gamma_prime:.3g}, α_min={row.alpha_min:.2f}",
        )
        ax.title.set_fontsize(8)
    axes[0][0].set_ylabel("‖o_i^(h)‖")
    fig.suptitle(f"Output norm vs sink attention {title}", fontsize=10)
    fig.tight_layout()
    return fig


def cone_head(snapshot: dict[str, Any], low_quantile: float = 0.25) -> tuple[int, int]:
    """The (layer, head) of the snapshot whose low-norm outputs move into the cone most
    when the sink is removed, weighted by the spread of its output norms (a head whose
    outputs all sit on the sink shows nothing); ties: the higher sink rate."""
    best, where = (-1.0, -1.0), (0, 0)
    layers = sorted(int(k.split("_")[-1]) for k in snapshot if k.startswith("sink_rate_"))
    for layer in layers:
        with_sink = np.asarray(snapshot[f"with_{layer}"])[:, 1:]  # (H, T-1, 2)
        without = np.asarray(snapshot[f"without_{layer}"])[:, 1:]
        cos_cone = np.asarray(snapshot[f"cos_cone_{layer}"])
        rates = np.asarray(snapshot[f"sink_rate_{layer}"])
        for h in range(with_sink.shape[0]):
            norm = np.linalg.norm(with_sink[h], axis=1)
            low = norm <= np.quantile(norm, low_quantile)

            def inside(p: np.ndarray, c: float = float(cos_cone[h])) -> np.ndarray:
                n = np.linalg.norm(p, axis=1)
                return (p[:, 0] >= c * n) & (n > 0)

            gain = float(inside(without[h])[low].mean() - inside(with_sink[h])[low].mean())
            spread = min(1.0, float(norm.std() / max(norm.mean(), 1e-30)))  # visible spread
            if (gain * spread, float(rates[h])) > best:
                best, where = (gain * spread, float(rates[h])), (layer, h)
    return where


def plot_semantic_cone(
    snapshot: dict[str, Any], head: tuple[int, int] | None = None, title: str = ""
) -> Figure:
    layer, h = head or cone_head(snapshot)
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.8), sharex=True, sharey=True)
    with_sink = np.asarray(snapshot[f"with_{layer}"][h])[1:]
    without = np.asarray(snapshot[f"without_{layer}"][h])[1:]
    norms = np.linalg.norm(with_sink, axis=1)
    angle = float(np.arccos(np.clip(float(snapshot[f"cos_cone_{layer}"][h]), -1, 1)))
    sink = np.asarray(snapshot[f"sink_{layer}"][h])
    reach = max(np.abs(with_sink).max(), np.abs(without).max(), np.abs(sink).max(), 1e-9) * 1.1
    for ax, pts, name in (
        (axes[0], with_sink, "(a) sink present"),
        (axes[1], without, "(b) sink value norm 0"),
    ):
        ax.fill(
            [0, reach * np.cos(angle), reach * np.cos(angle)],
            [0, reach * np.sin(angle), -reach * np.sin(angle)],
            color="tab:green",
            alpha=0.12,
        )
        for sgn in (1, -1):
            ax.plot([0, reach * np.cos(angle)], [0, sgn * reach * np.sin(angle)], "g--", lw=0.8)
        sc = ax.scatter(pts[:, 0], pts[:, 1], c=norms, cmap="viridis", s=8)
        ax.annotate(
            "",
            xy=(sink[0], sink[1]),
            xytext=(0, 0),
            arrowprops={"color": "tab:orange", "width": 1.2, "headwidth": 5, "headlength": 5},
        )
        ax.set(xlabel="⟨o, μ̂⟩", title=name, xlim=(-reach, reach), ylim=(-reach, reach))
    axes[0].set_ylabel("⟨o, û⟩")
    fig.colorbar(sc, ax=axes, label="‖o_i^(h)‖ (sink present)")
    fig.suptitle(f"Semantic cone, layer {layer} head {h} {title}", fontsize=10)
    return fig


def plot_joint_distributions(
    joint: pd.DataFrame, title: str = "", max_points: int = 200_000
) -> Figure:
    sample = joint.sample(min(len(joint), max_points), random_state=0) if len(joint) else joint
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, col, label in ((axes[0], "vnorm", "‖ṽ_j‖"), (axes[1], "kappa", "κ = cos(o_i, ṽ_j)")):
        if len(sample):
            *_, image = ax.hist2d(
                sample["alpha"],
                sample[col],
                bins=60,
                cmap="magma",
                norm=matplotlib.colors.LogNorm(),
            )
            fig.colorbar(image, ax=ax, label="pairs per bin (log scale)")
        ax.set(xlabel="α_ij", ylabel=label)
    mean_k = float(sample["kappa"].mean()) if len(sample) else float("nan")
    fig.suptitle(f"Joint distributions {title} (mean κ = {mean_k:.3f})", fontsize=10)
    fig.tight_layout()
    return fig


# ---- the figure of each analysis, registered by its name -----------------------------------
Draw = Callable[[Any, str], Figure | None]


@dataclass(frozen=True)
class GeometryFigure:
    """The figure of the analysis ``name``: ``draw(table, title)``, None when it has nothing."""

    name: str
    draw: Draw


GEOMETRY_FIGURES: Registry[GeometryFigure] = Registry("geometry figure")


def register_geometry_figure(name: str, draw: Draw) -> Draw:
    """Make ``draw(table, title) -> Figure | None`` the figure of the geometry analysis
    ``name`` (given that analysis' table); :func:`write_figures` saves it as
    ``geometry-<name>.png``. Returns ``draw``."""
    GEOMETRY_FIGURES.register(GeometryFigure(name, draw))
    return draw


def unregister_geometry_figure(name: str) -> None:
    """Remove the figure of ``name`` (tests, plugins that withdraw one)."""
    GEOMETRY_FIGURES.unregister(name)


def _first_token_weight(table: Any, title: str) -> Figure:
    return plot_first_token_weight(table.first_token_weight_by_layer, title)


def _sink_alignment(table: Any, title: str) -> Figure:
    return plot_sink_alignment(table.sink_alignment, title, table.null)


def _sink_scaling(table: Any, title: str) -> Figure | None:
    if table.skipped:
        return None
    return plot_sink_scaling(table.table, table.layers, title, table.control)


def _norm_fit(table: Any, title: str) -> Figure | None:
    if not table.norm_points or table.norm_fit.empty:  # a folder read without its state
        return None
    return plot_norm_fit(table.norm_fit, table.norm_points, title)


def _semantic_cone(table: Any, title: str) -> Figure | None:
    return plot_semantic_cone(table.cone_snapshot, title=title) if table.cone_snapshot else None


register_geometry_figure("first_token_weight", _first_token_weight)
register_geometry_figure("sink_alignment", _sink_alignment)
register_geometry_figure("sink_scaling", _sink_scaling)
register_geometry_figure("norm_fit", _norm_fit)
register_geometry_figure("semantic_cone", _semantic_cone)
register_geometry_figure("joint_distributions", plot_joint_distributions)

#: the built-in analyses with a figure, in order
FIGURES = tuple(GEOMETRY_FIGURES.names())


def write_figures(
    result: GeometryResult, out: str | Path, title: str = "", dpi: int = 110
) -> list[Path]:
    """One PNG per analysis of the result with a registered figure and data for it,
    named ``geometry-<analysis>.png``."""
    out = Path(out)
    paths = []
    for analysis, table in result.analysis_tables():
        if analysis.name not in GEOMETRY_FIGURES:
            continue
        fig = GEOMETRY_FIGURES.get(analysis.name).draw(table, title)
        if fig is not None:
            paths.append(save(fig, out / f"geometry-{analysis.name}.png", dpi=dpi))
    return paths


def markdown_tables(result: GeometryResult, title: str = "") -> str:
    """Every table of the result as Markdown: each analysis' section, in registry order."""
    parts = [f"# Value geometry and sinks: {title}".rstrip(": "), ""]
    for analysis, table in result.analysis_tables():
        parts += analysis.markdown(table, result)
    return "\n".join(parts)


def write_markdown(result: GeometryResult, path: str | Path, title: str = "") -> str:
    text = markdown_tables(result, title)
    Path(path).write_text(text + "\n")
    return text
