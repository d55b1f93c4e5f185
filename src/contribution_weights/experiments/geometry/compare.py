"""Geometry runs side by side: the cross-run tables of docs/geometry.md, built from the
run folders' files.

A comparison folder holds a ``compare.json`` that names the runs (their folders, next to
it, and the label each gets), grouped by length, and the paper's numbers (cells as the
paper reports them, typed once there). :func:`render` builds every table from the runs'
``tables.json``, ``per_layer.csv`` and ``sink_scaling.csv`` (the per-text NLLs, for the
paired rise in NLL from γ = 1 to γ = 0), :func:`differences` names the table files that
differ from the committed ones and :func:`rebuild` rewrites them (``cw results`` does,
before it copies them into the pages' generated blocks). Nothing is rerun and no number
is typed by hand outside ``compare.json``'s paper cells.

``compare.json``::

    {"groups": [{"name": "512", "bold": true,
                 "runs": [{"label": "SmolLM2, GSM8K, 512", "folder": "geometry-...",
                           "sink_scaling": "geometry-...-sink-layers-5-17"}]}],
     "paper": {"first_token_weight": [["paper: LLaMA-3.1-8B", "0.708", ...]], ...}}

A run's optional ``sink_scaling`` folder stands in for its own sink-scaling table where its
run found no sink layer (a run with the layers given); its cells say the layers were given.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ...fields import int_ranges
from ..contrasts import stale_files, write_stale
from ..paired import bootstrap_interval

SPEC = "compare.json"
FEATURES = ("alpha", "r", "kappa", "alpha*r", "alpha*kappa", "r*kappa")
LOG_FEATURES = (
    "log_alpha",
    "log_r",
    "log_kappa",
    "log_alpha+log_r",
    "log_alpha+log_kappa",
    "log_r+log_kappa",
)
GROUPS = ("all", "first", "tail")
MEASURES = ("attention", "vw", "contribution")


@dataclass
class Run:
    """One run of a comparison: its label, its folder and the files read from it."""

    label: str
    folder: Path
    bold: bool = False
    scaling_folder: Path | None = None  # the run with the sink layers given, if any

    @cached_property
    def tables(self) -> dict[str, Any]:
        return json.loads((self.folder / "tables.json").read_text())

    @cached_property
    def per_layer(self) -> pd.DataFrame:
        return pd.read_csv(self.folder / "per_layer.csv", index_col="layer")

    @property
    def name(self) -> str:
        return f"**{self.label}**" if self.bold else self.label

    @property
    def given(self) -> list[int] | None:
        """The sink layers given by hand (from the stand-in folder), or None."""
        if self.scaling_folder is None:
            return None
        return list(self._scaling_tables()["sink_scaling"]["layers"])

    def _scaling_tables(self) -> dict[str, Any]:
        if self.scaling_folder is None:
            return self.tables
        return json.loads((self.scaling_folder / "tables.json").read_text())

    @property
    def scaling(self) -> dict[str, Any]:
        """The sink-scaling table (the stand-in run's where the layers were given)."""
        return self._scaling_tables()["sink_scaling"]

    @cached_property
    def scaling_rows(self) -> pd.DataFrame:
        folder = self.scaling_folder or self.folder
        return pd.read_csv(folder / "sink_scaling.csv")


@dataclass
class Comparison:
    """The runs of a ``compare.json``, by group, and the paper's cells."""

    folder: Path
    groups: list[tuple[str, list[Run]]]
    paper: dict[str, list[list[str]]]

    @classmethod
    def load(cls, folder: str | Path) -> Comparison:
        folder = Path(folder)
        spec = json.loads((folder / SPEC).read_text())
        root = folder.parent
        groups = []
        for group in spec["groups"]:
            runs = [
                Run(
                    run["label"],
                    root / run["folder"],
                    bool(group.get("bold", False)),
                    root / run["sink_scaling"] if run.get("sink_scaling") else None,
                )
                for run in group["runs"]
            ]
            groups.append((str(group["name"]), runs))
        return cls(folder, groups, dict(spec.get("paper", {})))

    @property
    def runs(self) -> list[Run]:
        return [run for _, runs in self.groups for run in runs]


def _f(value: float, digits: int = 3) -> str:
    return f"{value:.{digits}f}"


def _signed(value: float, digits: int = 4) -> str:
    return f"{value:+.{digits}f}"


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _layers(layers: Sequence[int]) -> str:
    """``18, 20, 23–26``: runs of three or more consecutive layers as ranges."""
    return int_ranges(layers, dash="–", least=3)


def _gamma(rows: list[dict[str, Any]], gamma: float) -> dict[str, Any]:
    return next(row for row in rows if math.isclose(row["gamma"], gamma))


def _paper(comparison: Comparison, key: str) -> list[list[str]]:
    return [list(row) for row in comparison.paper.get(key, [])]


def first_token_weight(comparison: Comparison) -> str:
    """Table 4: mean first-token weight of each measure, and how many times contribution's
    attention's is (the paper's ratio from its cells)."""
    rows = []
    for row in _paper(comparison, "first_token_weight"):
        rows.append([*row, _f(float(row[1]) / float(row[3]), 2)])
    for run in comparison.runs:
        weight = run.tables["first_token_weight"]
        ratio = weight["attention"] / weight["contribution"]
        rows.append([run.name, *(_f(weight[m]) for m in MEASURES), _f(ratio, 2)])
    return _table(
        ["model, data", "attention", "VW", "contribution", "attention / contribution"], rows
    )


def entropy(comparison: Comparison) -> str:
    """Table 5: mean entropy of each measure, over all keys and over j ≥ 1."""
    rows = _paper(comparison, "entropy")
    for run in comparison.runs:
        ent = run.tables["entropy"]
        rows.append(
            [
                run.name,
                *(_f(ent["all"][m]) for m in MEASURES),
                *(_f(ent["excluding_first"][m]) for m in MEASURES),
            ]
        )
    header = ["model, data", "attention", "VW", "contribution"]
    header += ["attention (j ≥ 1)", "VW (j ≥ 1)", "contribution (j ≥ 1)"]
    return _table(header, rows)


def _regression(comparison: Comparison, key: str, features: Sequence[str], runs: list[Run]) -> str:
    paper = comparison.paper.get(key, [])
    header = ["features", *(row[0] for row in paper), *(run.name for run in runs)]
    rows = []
    for i, feature in enumerate(features):
        cells = [row[i + 1] for row in paper]
        for run in runs:
            r2 = run.tables[key]
            cells.append(" / ".join(_f(r2[g][feature]) for g in GROUPS))
        rows.append([feature, *cells])
    return _table(header, rows)


def correlations(comparison: Comparison) -> str:
    """Table 2: correlations of the log components over all pairs."""
    pairs = [("log_alpha", "log_r"), ("log_alpha", "log_kappa"), ("log_r", "log_kappa")]
    rows = _paper(comparison, "correlations")
    for run in comparison.runs:
        corr = run.tables["correlations"]["all"]
        rows.append([run.name, *(_f(corr[a][b]) for a, b in pairs)])
    return _table(
        ["model, data", "(log α, log r)", "(log α, log abs κ)", "(log r, log abs κ)"], rows
    )


def sinks(comparison: Comparison) -> str:
    """Figure 5, §6.2 and Figure 6 in one row per run."""
    rows = _paper(comparison, "sinks")
    for run in comparison.runs:
        t = run.tables
        rate = run.per_layer["sink_rate"]
        layers = t["sink_scaling"]["layers"]
        found = f"{len(layers)}: {_layers(layers)}" if layers else "none"
        given = run.given
        if given is not None:
            found += f" (given: {_layers(given)})"
        by_gamma = run.scaling["by_gamma"]
        clean, zero = _gamma(by_gamma, 1.0), _gamma(by_gamma, 0.0)
        ppl = f"{_f(clean['ppl_mean'], 2)} → {_f(zero['ppl_mean'], 2)}"
        if given is not None:
            ppl += f" ({_layers(given)} given)"
        fit = t["norm_fit"]["summary"]
        cone = t["semantic_cone"]["overall"]
        rows.append(
            [
                run.name,
                _f(t["sink_alignment"]["mean"]["sink_tail"]),
                _f(t["sink_alignment"]["mean"]["tail_tail"]),
                f"{int((run.per_layer['sink_tail'] < 0).sum())} of {len(run.per_layer)}",
                f"{_f(float(rate.max()), 3)} (layer {int(rate.idxmax())})",
                found,
                ppl,
                _f(fit["fraction_convex_min_below_1"]),
                f"{_f(fit['median_r2'])} / {_f(fit['fraction_r2_above_0.5'])}",
                _f(fit["fraction_gamma_prime_negative"]),
                f"{_f(cone['low_inside_with_sink'])} → {_f(cone['low_inside_without_sink'])}",
            ]
        )
    header = [
        "model, data",
        "mean cos(ṽ_0, ṽ_j)",
        "mean cos(ṽ_i, ṽ_j)",
        "layers with cos(ṽ_0, ṽ_j) < 0",
        "largest layer mean α_i0",
        "sink layers",
        "PPL γ=1 → γ=0",
        "heads convex with 0 < α_min < 1",
        "norm fit R²: median / heads with R² > 0.5",
        "heads with γ' < 0",
        "low-norm outputs in cone: with sink → without",
    ]
    return _table(header, rows)


def sink_scaling(comparison: Comparison) -> str:
    """Figure 6c: perplexity by γ, mean over texts ± standard error."""
    runs = comparison.runs
    gammas = [row["gamma"] for row in runs[0].scaling["by_gamma"]]
    rows = []
    for run in runs:
        by_gamma = run.scaling["by_gamma"]
        name = run.name
        if run.given is not None:
            name += f" (layers {_layers(run.given)} given)"
        cells = []
        for g in gammas:
            row = _gamma(by_gamma, g)
            cells.append(f"{_f(row['ppl_mean'], 2)} ± {_f(row['ppl_se'], 2)}")
        rows.append([name, *cells])
    return _table(["model, data", *(f"γ={g:g}" for g in gammas)], rows)


def _rise(rows: pd.DataFrame, scaled: str) -> np.ndarray:
    """Per text, NLL at γ = 0 minus NLL at γ = 1 with ``scaled`` (sink or control) scaled."""
    kept = rows[rows["scaled"] == scaled].pivot(index="seq", columns="gamma", values="nll")
    return (kept[0.0] - kept[1.0]).to_numpy()


def _interval(d: np.ndarray) -> str:
    low, high = bootstrap_interval(d)
    return f"{_signed(float(d.mean()))} [{_signed(low)}, {_signed(high)}]"


def nll_rise(runs: list[Run]) -> str:
    """The paired rise in NLL per text from γ = 1 to γ = 0, for the sink and the control
    token, and their difference: mean over texts and percentile-bootstrap 95% interval."""
    rows = []
    for run in runs:
        sink, control = _rise(run.scaling_rows, "sink"), _rise(run.scaling_rows, "control")
        name = run.name
        if run.given is not None:
            name += f" (layers {_layers(run.given)} given)"
        rows.append([name, _interval(sink), _interval(control), _interval(sink - control)])
    header = ["model, data", "sink: NLL γ=0 − γ=1 [95% CI]", "control token", "sink − control"]
    return _table(header, rows)


def null_controls(runs: list[Run]) -> str:
    """Each sink claim beside the same statistic with a control token in the sink's place."""

    def fit(run: Run, key: str) -> str:
        nf = run.tables["norm_fit"]
        return f"{_f(nf['summary'][key])} / {_f(nf['null']['summary'][key])}"

    def alignment(run: Run) -> str:
        o = run.tables["sink_alignment"]["null"]["overall"]
        return f"{_f(o['sink_tail'])} / {_f(o['null_mean'])} ± {_f(o['null_sd'])}"

    def cone(run: Run) -> str:
        o = run.tables["semantic_cone"]["null"]["overall"]
        sd = f"{o['low_null_sd']:.1g}"
        return f"{_f(o['low_inside_without_sink'])} / {_f(o['low_null_mean'])} ± {sd}"

    def scaling(run: Run) -> str:
        sink = _gamma(run.scaling["by_gamma"], 0.0)
        control = run.scaling["control"]["by_gamma"]
        zero, one = _gamma(control, 0.0), _gamma(control, 1.0)
        cell = (
            f"{_f(sink['ppl_mean'], 2)} ± {_f(sink['ppl_se'], 2)} / "
            f"{_f(zero['ppl_mean'], 2)} ± {_f(zero['ppl_se'], 2)} ({_f(one['ppl_mean'], 2)})"
        )
        if run.given is not None:
            cell = f"no sink layer; layers {_layers(run.given)} given: {cell}"
        return cell

    def fits(key: str) -> Callable[[Run], str]:
        return lambda run: fit(run, key)

    claims: list[tuple[str, Callable[[Run], str]]] = [
        ("norm fit: share of heads with 0 < α_min < 1", fits("fraction_convex_min_below_1")),
        ("norm fit: share of heads with any convex fit", fits("fraction_convex")),
        ("norm fit: median R²", fits("median_r2")),
        ("norm fit: share of heads with R² > 0.5", fits("fraction_r2_above_0.5")),
        ("sink-tail cosine / permutation null (mean ± sd)", alignment),
        ("semantic cone: low-norm outputs inside without the sink's value / null (mean ± sd)",
         cone),
        ("sink scaling: perplexity at γ = 0 / the same scaling of a control token (γ = 1)",
         scaling),
        ("one-sided permutation p: alignment / cone", _p_values),
    ]  # fmt: skip
    header = ["claim (token 0 / control token)", *(run.name for run in runs)]
    return _table(header, [[claim, *(cell(run) for run in runs)] for claim, cell in claims])


def _p_values(run: Run) -> str:
    align = run.tables["sink_alignment"]["null"]["overall"]["p_value"]
    cone = run.tables["semantic_cone"]["null"]["overall"]["low_p_value"]
    return f"{align:.4f} / {cone:.4f}"


def render(folder: str | Path) -> dict[str, str]:
    """Every table of the comparison in ``folder``, by file name."""
    comparison = Comparison.load(folder)
    out = {
        "first_token_weight.md": first_token_weight(comparison),
        "entropy.md": entropy(comparison),
        "correlations.md": correlations(comparison),
        "sinks.md": sinks(comparison),
        "sink_scaling.md": sink_scaling(comparison),
    }
    for name, runs in comparison.groups:
        out[f"regression-{name}.md"] = _regression(comparison, "regression_r2", FEATURES, runs)
        out[f"log_regression-{name}.md"] = _regression(
            comparison, "log_regression_r2", LOG_FEATURES, runs
        )
        out[f"null_controls-{name}.md"] = null_controls(runs)
        out[f"nll_rise-{name}.md"] = nll_rise(runs)
    return out


def comparison_folders(root: str | Path) -> list[Path]:
    """The folders under ``root`` that hold a ``compare.json``."""
    return sorted(path.parent for path in Path(root).rglob(SPEC))


def differences(folder: str | Path) -> list[str]:
    """The table files of the comparison in ``folder`` that differ from what its runs give."""
    return stale_files(Path(folder), render(folder))


def rebuild(folder: str | Path) -> list[str]:
    """Rewrite the comparison's table files that differ from what its runs give; which."""
    return write_stale(Path(folder), render(folder))
