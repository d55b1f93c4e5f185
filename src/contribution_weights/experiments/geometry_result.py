"""The geometry analyses: their options, their registry, and their result.

Each analysis is one :class:`Analysis` registered by name (:func:`register_analysis`):
the running statistics it needs, how they become its tables, its ``tables.json``
entries, its figure and its Markdown section. :class:`GeometryResult` holds one pandas
table (or small dataclass) per built-in analysis (``extra`` for others); fields of
analyses that were not run are None. :meth:`GeometryResult.to_json` gives the dict
written to ``tables.json`` with exactly the keys ``regression_r2``,
``log_regression_r2``, ``correlations``, ``first_token_weight``, ``entropy``,
``sink_alignment``, ``sink_scaling``, ``norm_fit``, ``semantic_cone``.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..registry import Registry
from ..runs import RunFolder, upgraded_config
from .options import GeometryOptions  # light: the CLI reads it before torch
from .regression import regression_tables
from .result import read_csv as read_rows
from .sinks import NormFit, SemanticCone
from .state_io import load_state, save_state
from .stats import (
    GROUPS,
    LOG_NAMES,
    WEIGHT_MEASURES,
    ComponentPoints,
    Entropy,
    FirstTokenWeight,
    LogCorrelations,
    SinkAlignment,
    SinkRate,
    Stat,
)

STATE_FILE = "state.pt"
SCALING_FILE = "sink_scaling.csv"


JSON_KEYS = (
    "regression_r2",
    "log_regression_r2",
    "correlations",
    "first_token_weight",
    "entropy",
    "sink_alignment",
    "sink_scaling",
    "norm_fit",
    "semantic_cone",
)
SCALING_COLUMNS = ("gamma", "ppl_mean", "ppl_se", "nll_mean", "nll_se", "ppl_of_mean_nll", "n")


@dataclass
class SinkScalingResult:
    """Perplexity against the sink-value scale γ (Figure 6c)."""

    layers: list[int]
    table: pd.DataFrame  # gamma, ppl_mean, ppl_se, nll_mean, nll_se, ppl_of_mean_nll, n
    skipped: str | None = None  # why the passes did not run (no sink layer); table empty

    def to_json(self) -> dict[str, Any]:
        return {"layers": self.layers, "by_gamma": _records(self.table), "skipped": self.skipped}


@dataclass
class GeometryResult:
    """Every analysis' table; None for analyses not run."""

    sequences: int
    num_layers: int
    sink_rate: pd.DataFrame  # per layer: sink_rate (mean α_i0)
    regression_r2: pd.DataFrame | None = None  # index features, columns all/first/tail
    log_regression_r2: pd.DataFrame | None = None
    points: dict[str, int] = field(default_factory=dict)  # sampled points per group
    correlations: pd.DataFrame | None = None  # 3×3, group "all"
    correlations_by_group: dict[str, pd.DataFrame] | None = None
    first_token_weight_by_layer: pd.DataFrame | None = None
    entropy: pd.DataFrame | None = None  # index all/excluding_first
    entropy_by_layer: pd.DataFrame | None = None
    sink_alignment: pd.DataFrame | None = None  # per layer sink_tail, tail_tail
    sink_scaling: SinkScalingResult | None = None
    norm_fit: pd.DataFrame | None = None  # per head
    norm_points: dict[tuple[int, int], np.ndarray] | None = None  # (alpha, norm2) samples
    semantic_cone: pd.DataFrame | None = None  # per layer fractions
    cone_snapshot: dict[str, Any] | None = None
    joint: pd.DataFrame | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # tables of registered analyses
    analyses: list[str] = field(default_factory=list)  # the analyses that ran
    # the run: its config and run_info, tokens per text, and what rebuilds the tables
    config: dict[str, Any] = field(default_factory=dict)
    run_info: dict[str, Any] = field(default_factory=dict)
    tokens: list[int] | None = None
    state: dict[str, Any] | None = field(default=None, repr=False)
    scaling_rows: list[dict[str, Any]] = field(default_factory=list, repr=False)

    def write_summary(self, folder: str | Path) -> None:
        """``tables.json``, ``per_layer.csv``, ``norm_fit.csv`` and ``meta.json`` (atomic)."""
        out = RunFolder.existing(folder, self.config)
        out.write_json("tables.json", self.to_json())
        per_layer = [self.sink_rate]
        if self.first_token_weight_by_layer is not None:
            per_layer.append(self.first_token_weight_by_layer.add_prefix("first_token_weight:"))
        if self.entropy_by_layer is not None:
            per_layer.append(self.entropy_by_layer.add_prefix("entropy:"))
        if self.sink_alignment is not None:
            per_layer.append(self.sink_alignment)
        out.write_bytes("per_layer.csv", pd.concat(per_layer, axis=1).to_csv().encode())
        if self.norm_fit is not None:
            out.write_bytes("norm_fit.csv", self.norm_fit.to_csv(index=False).encode())
        meta = {
            "sequences": self.sequences,
            "points": self.points,
            "model": self.config.get("model"),
        }
        if self.tokens is not None:
            meta["tokens"] = self.tokens
        out.write_json("meta.json", meta)

    def save(self, folder: str | Path) -> Path:
        """Write the run's files (config, run_info, state, sink-scaling rows and the
        tables) into ``folder``; :meth:`load` rebuilds this result from them."""
        if self.state is None:
            raise ValueError("this result has no accumulator state to save (build it with a run)")
        out = RunFolder.existing(folder, self.config)
        out.write_json("config.json", self.config, indent_sort=True)
        out.write_json("run_info.json", self.run_info)
        save_state(out.file(STATE_FILE), self.state)
        if self.scaling_rows:
            buf = io.StringIO()
            writer = csv.DictWriter(buf, fieldnames=list(self.scaling_rows[0]), lineterminator="\n")
            writer.writeheader()
            writer.writerows(self.scaling_rows)
            out.write_bytes(SCALING_FILE, buf.getvalue().encode())
        self.write_summary(out.path)
        return out.path

    @classmethod
    def load(cls, folder: str | Path) -> GeometryResult:
        """The result of the run (or :meth:`save`) in ``folder``, rebuilt from its state."""
        folder = Path(folder)
        if not (folder / "config.json").is_file() or not (folder / STATE_FILE).is_file():
            raise FileNotFoundError(
                f"{folder} holds no geometry run (config.json and {STATE_FILE}); pass a folder "
                "written by cw geometry or result.save()"
            )
        config = json.loads((folder / "config.json").read_text())
        names = [f.name for f in fields(GeometryOptions)]
        upgraded = upgraded_config(config)  # older runs' option names
        options = GeometryOptions(**{k: upgraded[k] for k in names if k in upgraded})
        state = load_state(folder / STATE_FILE)
        analyses = list(config["analyses"])
        stats = make_stats(analyses, int(state["num_layers"]), int(state["num_heads"]), options)
        for key, stat in stats.items():
            stat.load_state_dict(state["stats"][key])
        rows = read_rows(folder / SCALING_FILE)
        nll: dict[int, list[float]] = {}
        for row in rows:
            nll.setdefault(int(row["seq"]), []).append(float(row["nll"]))
        tables = json.loads((folder / "tables.json").read_text())
        scaling = tables.get("sink_scaling") or {}
        result = build_result(
            stats, analyses, options, int(state["num_layers"]), int(state["sequences"]),
            scaling.get("layers"), [nll[k] for k in sorted(nll)], scaling.get("skipped"),
        )  # fmt: skip
        info = folder / "run_info.json"
        result.config = config
        result.run_info = json.loads(info.read_text()) if info.is_file() else {}
        meta = folder / "meta.json"
        result.tokens = json.loads(meta.read_text()).get("tokens") if meta.is_file() else None
        result.state, result.scaling_rows = state, rows
        return result

    @property
    def first_token_weight(self) -> dict[str, float] | None:
        """Table 4: the mean over layers of the per-layer first-token weight."""
        if self.first_token_weight_by_layer is None:
            return None
        return {m: _num(self.first_token_weight_by_layer[m].mean()) for m in WEIGHT_MEASURES}

    def to_json(self) -> dict[str, Any]:
        """The ``tables.json`` dict: :data:`JSON_KEYS` (None for analyses not run), then
        the keys of any other registered analysis that ran."""
        out: dict[str, Any] = {key: None for key in JSON_KEYS}
        for name in self.analyses or analysis_names():
            analysis = get_analysis(name)
            for key in analysis.json_entries():
                out.setdefault(key, None)
            out.update(analysis.to_json(self))
        return out


def norm_fit_summary(t: pd.DataFrame) -> dict[str, Any]:
    if t.empty:
        return {"heads": 0}
    return {
        "heads": len(t),
        "fraction_convex_min_below_1": _num(t["convex_min_below_1"].mean()),
        "fraction_gamma_prime_negative": _num((t["gamma_prime"] < 0).mean()),
        "median_alpha_min": _num(t["alpha_min"].median()),
        "median_r2": _num(t["r2"].median()),
    }


def _num(x: Any) -> Any:
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    x = float(x)
    return None if math.isnan(x) or math.isinf(x) else x


def _records(t: pd.DataFrame) -> list[dict[str, Any]]:
    return [{str(k): _num(v) for k, v in row.items()} for row in t.to_dict("records")]


def _nested(t: pd.DataFrame) -> dict[str, dict[str, Any]]:
    return {str(c): {str(i): _num(t.loc[i, c]) for i in t.index} for c in t.columns}


def _scaling(layers: list[int], gammas: list[float], nll: np.ndarray) -> SinkScalingResult:
    """``nll (n_sequences, n_gammas)`` → mean ± standard error of PPL and NLL per γ.

    Sequences too short to score (NaN rows) are left out.
    """
    nll = nll[~np.isnan(nll).any(1)].reshape(-1, len(gammas))
    n = nll.shape[0]
    if n == 0:
        nll = np.full((1, len(gammas)), np.nan)
    ppl = np.exp(nll)

    def se(x: np.ndarray) -> np.ndarray:
        return x.std(0, ddof=1) / math.sqrt(n) if n > 1 else np.full(x.shape[1], np.nan)

    table = pd.DataFrame(
        {
            "gamma": gammas,
            "ppl_mean": ppl.mean(0),
            "ppl_se": se(ppl),
            "nll_mean": nll.mean(0),
            "nll_se": se(nll),
            "ppl_of_mean_nll": np.exp(nll.mean(0)),
            "n": n,
        }
    )
    return SinkScalingResult(layers, table)


# ---- the analyses, registered by name -----------------------------------------------------
@dataclass
class TableContext:
    """What an analysis builds its tables from: the run's statistics and its scaling passes."""

    stats: dict[str, Stat]
    options: GeometryOptions
    num_layers: int
    sink_layers: list[int] | None = None
    scaling_nll: list[list[float]] | None = None
    scaling_skipped: str | None = None
    groups: dict[str, dict[str, np.ndarray]] | None = None  # the sampled points per group

    @property
    def layers(self) -> pd.RangeIndex:
        return pd.RangeIndex(self.num_layers, name="layer")


class Analysis:
    """One geometry analysis, everything about it in one class.

    ``stats`` names the running statistics it needs (shared by name: two analyses asking
    for ``"points"`` share one sample); ``build`` turns them into its tables on the
    :class:`GeometryResult` (a built-in field, or ``result.extra[name]``); ``to_json``
    gives its entries of ``tables.json``; ``figure`` its matplotlib figure (or None);
    ``markdown`` its section of ``tables.md``. Register an instance with
    :func:`register_analysis` and ``cw geometry --only NAME`` runs it.
    """

    name: str = ""
    aliases: tuple[str, ...] = ()
    json_keys: tuple[str, ...] = ()  # default (name,)

    def stats(self, num_layers: int, num_heads: int, options: GeometryOptions) -> dict[str, Stat]:
        return {}

    def build(self, ctx: TableContext, result: GeometryResult) -> None:
        """Fill ``result`` with this analysis' tables."""

    def to_json(self, result: GeometryResult) -> dict[str, Any]:
        return {}

    def figure(self, result: GeometryResult, title: str = "") -> Any:
        return None

    def markdown(self, result: GeometryResult) -> list[str]:
        return []

    def json_entries(self) -> tuple[str, ...]:
        return self.json_keys or (self.name,)


ANALYSES_REGISTRY: Registry[Analysis] = Registry("analysis", plural="analyses")


def register_analysis(analysis: Analysis) -> Analysis:
    """Add (or replace) an analysis by its name; returns it."""
    return ANALYSES_REGISTRY.register(analysis)


def get_analysis(name: str) -> Analysis:
    return ANALYSES_REGISTRY.get(name)


def analysis_names() -> list[str]:
    """Every registered analysis, built-in ones first, in order."""
    return ANALYSES_REGISTRY.names()


def resolve_analyses(only: str | Iterable[str] | None) -> list[str]:
    """``None`` (all), a comma-separated string, or names (or aliases) of registered analyses."""
    return ANALYSES_REGISTRY.resolve(only)


def make_stats(
    analyses: Sequence[str], num_layers: int, num_heads: int, options: GeometryOptions
) -> dict[str, Stat]:
    """The running statistics the analyses need (``sink_rate`` always: it finds sink layers)."""
    stats: dict[str, Stat] = {"sink_rate": SinkRate(num_layers)}
    for name in analyses:
        for key, stat in get_analysis(name).stats(num_layers, num_heads, options).items():
            stats.setdefault(key, stat)
    return stats


def build_result(
    stats: dict[str, Stat],
    analyses: Sequence[str],
    options: GeometryOptions,
    num_layers: int,
    sequences: int,
    sink_layers: list[int] | None = None,
    scaling_nll: list[list[float]] | None = None,
    scaling_skipped: str | None = None,
) -> GeometryResult:
    """Turn running statistics (and the sink-scaling NLLs per sequence) into tables."""
    ctx = TableContext(stats, options, num_layers, sink_layers, scaling_nll, scaling_skipped)
    rate = stats["sink_rate"]
    assert isinstance(rate, SinkRate)
    res = GeometryResult(
        sequences, num_layers, pd.DataFrame(rate.by_layer(), ctx.layers, ["sink_rate"])
    )
    res.analyses = list(analyses)
    pts = stats.get("points")
    if isinstance(pts, ComponentPoints):  # the sample's columns, read once for every analysis
        ctx.groups = {g: pts.group(g) for g in GROUPS}
        res.points = {g: len(cols["alpha"]) for g, cols in ctx.groups.items()}
    for name in analyses:
        get_analysis(name).build(ctx, res)
    return res


def _figure(name: str) -> Any:
    """A plotting function of the presentation layer (imported when a figure is drawn)."""
    from ..presentation import geometry_plots

    return getattr(geometry_plots, name)


def _points_stat(n: int, h: int, o: GeometryOptions) -> dict[str, Stat]:
    return {"points": ComponentPoints(n, o.cap, o.seed)}


class Regression(Analysis):
    """Tables 1 and 3: held-out R² of ĉ on its components, linear and in logs."""

    name = "regression"
    aliases = ("regression_r2", "log_regression_r2")
    json_keys = ("regression_r2", "log_regression_r2")

    def stats(self, num_layers: int, num_heads: int, options: GeometryOptions) -> dict[str, Stat]:
        return _points_stat(num_layers, num_heads, options)

    def build(self, ctx: TableContext, result: GeometryResult) -> None:
        assert ctx.groups is not None
        lin, log = regression_tables(ctx.groups, ctx.options.folds, ctx.options.seed)
        result.regression_r2 = pd.DataFrame(lin).rename_axis("features")
        result.log_regression_r2 = pd.DataFrame(log).rename_axis("features")

    def to_json(self, result: GeometryResult) -> dict[str, Any]:
        if result.regression_r2 is None or result.log_regression_r2 is None:
            return {}
        return {
            "regression_r2": _nested(result.regression_r2),
            "log_regression_r2": _nested(result.log_regression_r2),
        }


class Correlations(Analysis):
    """Table 2: Pearson correlations of log α, log r, log|κ| (exact, every valid pair)."""

    name = "correlations"

    def stats(self, num_layers: int, num_heads: int, options: GeometryOptions) -> dict[str, Stat]:
        return {"correlations": LogCorrelations(num_layers)}

    def build(self, ctx: TableContext, result: GeometryResult) -> None:
        corr = ctx.stats["correlations"]
        assert isinstance(corr, LogCorrelations)
        result.correlations_by_group = {
            g: pd.DataFrame(m.correlation(), LOG_NAMES, LOG_NAMES).assign(n=m.n)
            for g, m in corr.moments.items()
        }
        result.correlations = result.correlations_by_group["all"].drop(columns="n")

    def to_json(self, result: GeometryResult) -> dict[str, Any]:
        if result.correlations_by_group is None:
            return {}
        return {"correlations": {g: _nested(t) for g, t in result.correlations_by_group.items()}}


class FirstTokenWeightAnalysis(Analysis):
    """Table 4: the first-token weight per layer and its mean over layers."""

    name = "first_token_weight"

    def stats(self, num_layers: int, num_heads: int, options: GeometryOptions) -> dict[str, Stat]:
        return {"first_token_weight": FirstTokenWeight(num_layers)}

    def build(self, ctx: TableContext, result: GeometryResult) -> None:
        ftw = ctx.stats["first_token_weight"]
        assert isinstance(ftw, FirstTokenWeight)
        result.first_token_weight_by_layer = pd.DataFrame(
            ftw.by_layer(), ctx.layers, list(ftw.columns)
        )

    def to_json(self, result: GeometryResult) -> dict[str, Any]:
        return (
            {}
            if result.first_token_weight is None
            else {"first_token_weight": result.first_token_weight}
        )

    def figure(self, result: GeometryResult, title: str = "") -> Any:
        if result.first_token_weight_by_layer is None:
            return None
        return _figure("plot_first_token_weight")(result.first_token_weight_by_layer, title)


class EntropyAnalysis(Analysis):
    """Table 5: entropy of each weight measure, with and without token 0."""

    name = "entropy"

    def stats(self, num_layers: int, num_heads: int, options: GeometryOptions) -> dict[str, Stat]:
        return {"entropy": Entropy(num_layers)}

    def build(self, ctx: TableContext, result: GeometryResult) -> None:
        ent = ctx.stats["entropy"]
        assert isinstance(ent, Entropy)
        by_layer = pd.DataFrame(ent.by_layer(), ctx.layers, list(ent.columns))
        result.entropy_by_layer = by_layer
        means = by_layer.mean()
        result.entropy = pd.DataFrame(
            {m: [means[f"{m}:all"], means[f"{m}:excluding_first"]] for m in WEIGHT_MEASURES},
            index=["all", "excluding_first"],
        )

    def to_json(self, result: GeometryResult) -> dict[str, Any]:
        if result.entropy is None:
            return {}
        t = result.entropy
        return {
            "entropy": {
                row: {m: _num(t.loc[row, m]) for m in WEIGHT_MEASURES}
                for row in ("all", "excluding_first")
            }
        }


class SinkAlignmentAnalysis(Analysis):
    """Figure 5: per layer, mean cos(ṽ_0, ṽ_j) and cos(ṽ_i, ṽ_j)."""

    name = "sink_alignment"

    def stats(self, num_layers: int, num_heads: int, options: GeometryOptions) -> dict[str, Stat]:
        return {"sink_alignment": SinkAlignment(num_layers)}

    def build(self, ctx: TableContext, result: GeometryResult) -> None:
        align = ctx.stats["sink_alignment"]
        assert isinstance(align, SinkAlignment)
        result.sink_alignment = pd.DataFrame(align.by_layer(), ctx.layers, list(align.columns))

    def to_json(self, result: GeometryResult) -> dict[str, Any]:
        t = result.sink_alignment
        if t is None:
            return {}
        return {
            "sink_alignment": {
                "mean": {c: _num(t[c].mean()) for c in ("sink_tail", "tail_tail")},
                "by_layer": _records(t.reset_index()),
            }
        }

    def figure(self, result: GeometryResult, title: str = "") -> Any:
        if result.sink_alignment is None:
            return None
        return _figure("plot_sink_alignment")(result.sink_alignment, title)


class SinkScaling(Analysis):
    """Figure 6c: perplexity with v_0 scaled by γ in the sink layers (its own passes)."""

    name = "sink_scaling"

    def build(self, ctx: TableContext, result: GeometryResult) -> None:
        if ctx.scaling_skipped:
            empty = pd.DataFrame(columns=[*SCALING_COLUMNS])
            result.sink_scaling = SinkScalingResult([], empty, ctx.scaling_skipped)
        elif ctx.scaling_nll:  # NaN rows: too short
            result.sink_scaling = _scaling(
                ctx.sink_layers or [], list(ctx.options.gammas), np.array(ctx.scaling_nll)
            )

    def to_json(self, result: GeometryResult) -> dict[str, Any]:
        return (
            {} if result.sink_scaling is None else {"sink_scaling": result.sink_scaling.to_json()}
        )

    def figure(self, result: GeometryResult, title: str = "") -> Any:
        s = result.sink_scaling
        if s is None or s.skipped:
            return None
        return _figure("plot_sink_scaling")(s.table, s.layers, title)


class NormFitAnalysis(Analysis):
    """§6.2: per head, the fit of ‖o‖² on the sink attention."""

    name = "norm_fit"

    def stats(self, num_layers: int, num_heads: int, options: GeometryOptions) -> dict[str, Stat]:
        return {"norm_fit": NormFit(num_layers, num_heads)}

    def build(self, ctx: TableContext, result: GeometryResult) -> None:
        fit = ctx.stats["norm_fit"]
        assert isinstance(fit, NormFit)
        result.norm_fit = pd.DataFrame(fit.fit())
        result.norm_points = {
            (i, h): np.column_stack(list(r.to_numpy().values()))  # in key order
            for i, row in enumerate(fit.points)
            for h, r in enumerate(row)
            if len(r)
        }

    def to_json(self, result: GeometryResult) -> dict[str, Any]:
        if result.norm_fit is None:
            return {}
        return {
            "norm_fit": {
                "summary": norm_fit_summary(result.norm_fit),
                "heads": _records(result.norm_fit),
            }
        }

    def figure(self, result: GeometryResult, title: str = "") -> Any:
        if result.norm_fit is None or not result.norm_points or result.norm_fit.empty:
            return None
        return _figure("plot_norm_fit")(result.norm_fit, result.norm_points, title)


class SemanticConeAnalysis(Analysis):
    """Figure 6a/b: low-norm head outputs inside the 90% cone, with and without the sink."""

    name = "semantic_cone"

    def stats(self, num_layers: int, num_heads: int, options: GeometryOptions) -> dict[str, Stat]:
        return {
            "semantic_cone": SemanticCone(
                num_layers, num_heads, options.low_quantile, options.cone_coverage
            )
        }

    def build(self, ctx: TableContext, result: GeometryResult) -> None:
        cone = ctx.stats["semantic_cone"]
        assert isinstance(cone, SemanticCone)
        cols = [
            "low_inside_with_sink",
            "low_inside_without_sink",
            "all_inside_with_sink",
            "all_inside_without_sink",
        ]
        table = pd.DataFrame(cone.fractions(), pd.Index(range(ctx.num_layers), name="layer"), cols)
        total = cone.counts.sum(0)
        with np.errstate(invalid="ignore", divide="ignore"):
            overall = [
                total[1] / total[0],
                total[2] / total[0],
                total[4] / total[3],
                total[5] / total[3],
            ]
        table.index = table.index.astype(object)
        table.loc["all"] = overall
        table["low_norm_outputs"] = [int(x) for x in [*cone.counts[:, 0], total[0]]]
        result.semantic_cone = table
        result.cone_snapshot = dict(cone.snapshot)

    def to_json(self, result: GeometryResult) -> dict[str, Any]:
        c = result.semantic_cone
        if c is None:
            return {}
        return {
            "semantic_cone": {
                "overall": _records(c[c.index == "all"])[0] if "all" in c.index else None,
                "by_layer": _records(c[c.index != "all"].reset_index()),
            }
        }

    def figure(self, result: GeometryResult, title: str = "") -> Any:
        if not result.cone_snapshot:
            return None
        return _figure("plot_semantic_cone")(result.cone_snapshot, title=title)


class JointDistributions(Analysis):
    """Figure 7: the sampled (α, ‖ṽ‖, κ) pairs."""

    name = "joint_distributions"
    aliases = ("joint",)

    def json_entries(self) -> tuple[str, ...]:
        return ()  # a figure only: nothing in tables.json

    def stats(self, num_layers: int, num_heads: int, options: GeometryOptions) -> dict[str, Stat]:
        return _points_stat(num_layers, num_heads, options)

    def build(self, ctx: TableContext, result: GeometryResult) -> None:
        assert ctx.groups is not None
        result.joint = pd.DataFrame({k: v for k, v in ctx.groups["all"].items() if k != "c"})

    def figure(self, result: GeometryResult, title: str = "") -> Any:
        if result.joint is None:
            return None
        return _figure("plot_joint_distributions")(result.joint, title)


for _analysis in (
    Regression(),
    Correlations(),
    FirstTokenWeightAnalysis(),
    EntropyAnalysis(),
    SinkAlignmentAnalysis(),
    SinkScaling(),
    NormFitAnalysis(),
    SemanticConeAnalysis(),
    JointDistributions(),
):
    register_analysis(_analysis)


#: the built-in analyses, in their order in tables.json, tables.md and the figures
ANALYSES = tuple(analysis_names())
