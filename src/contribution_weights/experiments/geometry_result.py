"""The result of the geometry analyses: tidy tables, and their JSON form (``tables.json``).

:class:`GeometryResult` holds one pandas table (or small dataclass) per analysis; fields
of analyses that were not run are None. :meth:`GeometryResult.to_json` gives the dict
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

from ..runs import RunFolder, upgraded_config
from .options import Options, as_floats, option
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

ANALYSES = (
    "regression",
    "correlations",
    "first_token_weight",
    "entropy",
    "sink_alignment",
    "sink_scaling",
    "norm_fit",
    "semantic_cone",
    "joint_distributions",
)
DEFAULT_GAMMAS = (1.0, 0.8, 0.6, 0.4, 0.2, 0.0)
SINK_LAYER_THRESHOLD = 0.5
STATE_FILE = "state.pt"
SCALING_FILE = "sink_scaling.csv"


@dataclass
class GeometryOptions(Options):
    """Options shared by the analyses and ``cw geometry`` (checked on creation).

    Attributes:
        max_tokens: texts longer than this are cut to their first ``max_tokens`` tokens.
        cap: most sampled (query, key, head, layer) points kept for the regressions (per
            reservoir: all pairs, and j = 0 pairs).
        folds: cross-validation folds of the regressions.
        seed: seed of the point sampling and of the folds.
        gammas: sink-value scales for the perplexity curve.
        sink_layers: layers to scale v_0 in; None detects them (mean α_i0 above
            ``sink_layer_threshold``).
        sink_layer_threshold: a layer is a sink layer when its mean attention to token 0,
            mean α_i0, is above this (a mean attention weight, in [0, 1]; not the
            hidden-state cosine that marks sink tokens in faithfulness).
        low_quantile: outputs at or below this quantile of ‖o_i^(h)‖ count as low-norm.
        cone_coverage: fraction of non-sink values the semantic cone holds.
    """

    max_tokens: int | None = option(256, "cut texts to N tokens", flag="--max-tokens", parse="int")
    cap: int = option(5_000_000, "sampled regression points", flag="--cap", parse="int")
    folds: int = option(5, "cross-validation folds of the regressions")
    seed: int = option(0, "sampling and fold seed", flag="--seed", parse="int")
    gammas: list[float] = option(
        DEFAULT_GAMMAS, "sink-value scales γ, each in [0, 1]", flag="--gammas", parse="floats"
    )
    sink_layers: list[int] | None = option(
        None,
        "layers to scale v_0 in, e.g. 2-29 (default: detected, mean α_i0 above "
        "--sink-layer-threshold)",
        flag="--sink-layers", parse="ints",
    )  # fmt: skip
    sink_layer_threshold: float = option(
        SINK_LAYER_THRESHOLD,
        "a layer is a sink layer when its mean attention to token 0 is above this",
        flag="--sink-layer-threshold", parse="float", aliases=("--sink-threshold",),
    )  # fmt: skip
    low_quantile: float = option(0.25, "quantile of ‖o_i^(h)‖ at or below which it is low")
    cone_coverage: float = option(0.9, "fraction of non-sink values the semantic cone holds")

    def validate(self) -> None:
        if self.max_tokens is not None and int(self.max_tokens) < 2:
            raise ValueError(f"max_tokens must be at least 2, not {self.max_tokens}")
        if int(self.cap) < 1:
            raise ValueError(f"cap must be at least 1, not {self.cap}")
        if int(self.folds) < 2:
            raise ValueError(f"folds must be at least 2, not {self.folds}")
        gammas = as_floats(self.gammas)
        if not gammas or any(not 0 <= g <= 1 for g in gammas):
            raise ValueError(f"gammas must lie in [0, 1], got {self.gammas}")
        self.gammas = gammas
        if self.sink_layers is not None:
            self.sink_layers = [int(x) for x in self.sink_layers]
        if not 0 <= float(self.sink_layer_threshold) <= 1:
            raise ValueError(
                "sink_layer_threshold is a mean attention weight, in [0, 1]; got "
                f"{self.sink_layer_threshold} (default {SINK_LAYER_THRESHOLD})"
            )
        self.sink_layer_threshold = float(self.sink_layer_threshold)
        if not 0 < float(self.low_quantile) < 1 or not 0 < float(self.cone_coverage) <= 1:
            raise ValueError("low_quantile must lie in (0, 1) and cone_coverage in (0, 1]")


def resolve_analyses(only: str | Iterable[str] | None) -> list[str]:
    """``None`` (all), a comma-separated string, or names; checked against :data:`ANALYSES`."""
    if only is None:
        return list(ANALYSES)
    names = [n.strip() for n in only.split(",")] if isinstance(only, str) else list(only)
    aliases = {
        "regression_r2": "regression",
        "log_regression_r2": "regression",
        "joint": "joint_distributions",
    }
    out: list[str] = []
    for name in filter(None, names):
        name = aliases.get(name, name)
        if name not in ANALYSES:
            raise ValueError(f"unknown analysis {name!r}; valid: {', '.join(ANALYSES)}")
        if name not in out:
            out.append(name)
    if not out:
        raise ValueError(f"no analysis named; valid: {', '.join(ANALYSES)}")
    return out


def make_stats(
    analyses: Sequence[str], num_layers: int, num_heads: int, options: GeometryOptions
) -> dict[str, Stat]:
    """The running statistics the analyses need (``sink_rate`` always)."""
    o, n, h = options, num_layers, num_heads
    want = set(analyses)
    stats: dict[str, Stat] = {"sink_rate": SinkRate(n)}
    if want & {"regression", "joint_distributions"}:
        stats["points"] = ComponentPoints(n, o.cap, o.seed)
    if "correlations" in want:
        stats["correlations"] = LogCorrelations(n)
    if "first_token_weight" in want:
        stats["first_token_weight"] = FirstTokenWeight(n)
    if "entropy" in want:
        stats["entropy"] = Entropy(n)
    if "sink_alignment" in want:
        stats["sink_alignment"] = SinkAlignment(n)
    if "norm_fit" in want:
        stats["norm_fit"] = NormFit(n, h)
    if "semantic_cone" in want:
        stats["semantic_cone"] = SemanticCone(n, h, o.low_quantile, o.cone_coverage)
    return stats


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
        out: dict[str, Any] = {key: None for key in JSON_KEYS}
        if self.regression_r2 is not None and self.log_regression_r2 is not None:
            out["regression_r2"] = _nested(self.regression_r2)
            out["log_regression_r2"] = _nested(self.log_regression_r2)
        if self.correlations_by_group is not None:
            out["correlations"] = {g: _nested(t) for g, t in self.correlations_by_group.items()}
        if self.first_token_weight is not None:
            out["first_token_weight"] = self.first_token_weight
        if self.entropy is not None:
            out["entropy"] = {
                row: {m: _num(self.entropy.loc[row, m]) for m in WEIGHT_MEASURES}
                for row in ("all", "excluding_first")
            }
        if self.sink_alignment is not None:
            t = self.sink_alignment
            out["sink_alignment"] = {
                "mean": {c: _num(t[c].mean()) for c in ("sink_tail", "tail_tail")},
                "by_layer": _records(t.reset_index()),
            }
        if self.sink_scaling is not None:
            out["sink_scaling"] = self.sink_scaling.to_json()
        if self.norm_fit is not None:
            out["norm_fit"] = {
                "summary": norm_fit_summary(self.norm_fit),
                "heads": _records(self.norm_fit),
            }
        if self.semantic_cone is not None:
            c = self.semantic_cone
            out["semantic_cone"] = {
                "overall": _records(c[c.index == "all"])[0] if "all" in c.index else None,
                "by_layer": _records(c[c.index != "all"].reset_index()),
            }
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
    s, o, layers = stats, options, pd.RangeIndex(num_layers, name="layer")
    rate = s["sink_rate"]
    assert isinstance(rate, SinkRate)
    res = GeometryResult(
        sequences, num_layers, pd.DataFrame(rate.by_layer(), layers, ["sink_rate"])
    )
    pts = s.get("points")
    if isinstance(pts, ComponentPoints):
        groups = {g: pts.group(g) for g in GROUPS}
        res.points = {g: len(cols["alpha"]) for g, cols in groups.items()}
        if "regression" in analyses:
            lin, log = regression_tables(groups, o.folds, o.seed)
            res.regression_r2 = pd.DataFrame(lin).rename_axis("features")
            res.log_regression_r2 = pd.DataFrame(log).rename_axis("features")
        if "joint_distributions" in analyses:
            res.joint = pd.DataFrame({k: v for k, v in groups["all"].items() if k != "c"})
    corr = s.get("correlations")
    if isinstance(corr, LogCorrelations):
        res.correlations_by_group = {
            g: pd.DataFrame(m.correlation(), LOG_NAMES, LOG_NAMES).assign(n=m.n)
            for g, m in corr.moments.items()
        }
        res.correlations = res.correlations_by_group["all"].drop(columns="n")
    ftw = s.get("first_token_weight")
    if isinstance(ftw, FirstTokenWeight):
        res.first_token_weight_by_layer = pd.DataFrame(ftw.by_layer(), layers, list(ftw.columns))
    ent = s.get("entropy")
    if isinstance(ent, Entropy):
        by_layer = pd.DataFrame(ent.by_layer(), layers, list(ent.columns))
        res.entropy_by_layer = by_layer
        means = by_layer.mean()
        res.entropy = pd.DataFrame(
            {m: [means[f"{m}:all"], means[f"{m}:excluding_first"]] for m in WEIGHT_MEASURES},
            index=["all", "excluding_first"],
        )
    align = s.get("sink_alignment")
    if isinstance(align, SinkAlignment):
        res.sink_alignment = pd.DataFrame(align.by_layer(), layers, list(align.columns))
    if "sink_scaling" in analyses and scaling_skipped:
        empty = pd.DataFrame(columns=[*SCALING_COLUMNS])
        res.sink_scaling = SinkScalingResult([], empty, scaling_skipped)
    elif "sink_scaling" in analyses and scaling_nll:  # NaN rows: too short
        res.sink_scaling = _scaling(sink_layers or [], list(o.gammas), np.array(scaling_nll))
    fit = s.get("norm_fit")
    if isinstance(fit, NormFit):
        res.norm_fit = pd.DataFrame(fit.fit())
        res.norm_points = {
            (i, h): np.column_stack(list(r.to_numpy().values()))  # in key order
            for i, row in enumerate(fit.points)
            for h, r in enumerate(row)
            if len(r)
        }
    cone = s.get("semantic_cone")
    if isinstance(cone, SemanticCone):
        cols = [
            "low_inside_with_sink",
            "low_inside_without_sink",
            "all_inside_with_sink",
            "all_inside_without_sink",
        ]
        table = pd.DataFrame(cone.fractions(), pd.Index(range(num_layers), name="layer"), cols)
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
        res.semantic_cone = table
        res.cone_snapshot = dict(cone.snapshot)
    return res


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
