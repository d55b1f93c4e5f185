"""The result of the geometry analyses: one table per analysis that ran, and its files.

:class:`GeometryResult` holds ``tables``, a dict keyed by analysis name (built-in and
registered ones alike), each value what that analysis built; ``result.<name>`` reads the
names each analysis answers (``result.norm_fit``, ``result.regression_r2``,
``result.joint``: None for analyses not run). :meth:`GeometryResult.to_json` gives the dict
written to ``tables.json``: the built-in keys :data:`~.analyses.JSON_KEYS` always (None for
analyses not run), then those of other registered analyses that ran. A run folder is
read back from its accumulator state (``state.pt``) when it has one, else from the
tables it wrote (the published folders keep no state).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import pandas as pd

from ...runs import RunFolder, upgraded_config
from ..options import GeometryOptions
from ..result import read_csv as read_rows
from ..state_io import load_state, save_state
from ..stats import GROUPS, ComponentPoints, SinkRate, Stat
from .analyses import JSON_KEYS
from .analyses.sink_scaling import SinkScalingResult
from .analysis import ANALYSES_REGISTRY, Analysis, analysis_names, get_analysis, make_stats
from .analysis_types import SavedRun, TableContext

STATE_FILE = "state.pt"
SCALING_FILE = "sink_scaling.csv"


@dataclass
class GeometryResult:
    """Every analysis' table (``tables``, by analysis name), and the run behind them."""

    sequences: int
    num_layers: int
    sink_rate: pd.DataFrame  # per layer: sink_rate (mean α_i0)
    tables: dict[str, Any] = field(default_factory=dict)  # analysis name -> its table
    points: dict[str, int] = field(default_factory=dict)  # sampled points per group
    analyses: list[str] = field(default_factory=list)  # the analyses that ran
    # the run: its config and run_info, tokens per text, and what rebuilds the tables
    config: dict[str, Any] = field(default_factory=dict)
    run_info: dict[str, Any] = field(default_factory=dict)
    tokens: list[int] | None = None
    state: dict[str, Any] | None = field(default=None, repr=False)
    scaling_rows: list[dict[str, Any]] = field(default_factory=list, repr=False)

    def __getattr__(self, name: str) -> Any:
        """``result.<name>``: what a registered analysis answers for ``name`` from its
        table (None when it did not run), else the table of the analysis ``name``."""
        tables = self.__dict__.get("tables")
        if name.startswith("_") or tables is None:
            raise AttributeError(name)
        for analysis in ANALYSES_REGISTRY:
            if name in analysis.attribute_names():
                table = tables.get(analysis.name)
                return None if table is None else analysis.attribute(table, name)
        if name in tables:
            return tables[name]
        raise AttributeError(
            f"{type(self).__name__} has no attribute {name!r} (no registered analysis "
            f"answers it; analyses with tables: {', '.join(tables) or 'none'})"
        )

    def analysis_tables(self) -> list[tuple[Analysis[Any], Any]]:
        """(analysis, table) for every registered analysis with a table, in registry order."""
        return [(a, self.tables[a.name]) for a in ANALYSES_REGISTRY if a.name in self.tables]

    def to_json(self) -> dict[str, Any]:
        """The ``tables.json`` dict: :data:`JSON_KEYS` (None for analyses not run), then
        the keys of any other registered analysis that ran."""
        out: dict[str, Any] = {key: None for key in JSON_KEYS}
        for name in self.analyses or analysis_names():
            analysis = get_analysis(name)
            for key in analysis.json_entries():
                out.setdefault(key, None)
            table = self.tables.get(analysis.name)
            if table is not None:
                out.update(analysis.to_json(table))
        return out

    def write_summary(self, folder: str | Path) -> None:
        """``tables.json``, ``per_layer.csv``, each analysis' files (``norm_fit.csv``) and
        ``meta.json`` (each replaced atomically)."""
        out = RunFolder.existing(folder, self.config)
        out.write_json("tables.json", self.to_json())
        per_layer = [self.sink_rate]
        files: dict[str, bytes] = {}
        for analysis, table in self.analysis_tables():
            columns = analysis.per_layer(table)
            if columns is not None:
                per_layer.append(columns)
            files.update(analysis.files(table))
        out.write_bytes("per_layer.csv", pd.concat(per_layer, axis=1).to_csv().encode())
        for name, data in files.items():
            out.write_bytes(name, data)
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
        """The result of the run (or :meth:`save`) in ``folder``: rebuilt from its state
        when it has one (``state.pt``), else from the tables it wrote (``tables.json``,
        ``per_layer.csv``: the tables, without the sampled points behind some figures)."""
        folder = Path(folder)
        has_state = (folder / STATE_FILE).is_file()
        if not (folder / "config.json").is_file() or not (
            has_state or (folder / "tables.json").is_file()
        ):
            raise FileNotFoundError(
                f"{folder} holds no geometry run (config.json, and {STATE_FILE} or "
                "tables.json); pass a folder written by cw geometry or result.save()"
            )
        config = json.loads((folder / "config.json").read_text())
        rows = read_rows(folder / SCALING_FILE)
        result = _from_state(folder, config, rows) if has_state else _from_tables(folder, config)
        info = folder / "run_info.json"
        result.config = config
        result.run_info = json.loads(info.read_text()) if info.is_file() else {}
        meta = folder / "meta.json"
        result.tokens = json.loads(meta.read_text()).get("tokens") if meta.is_file() else None
        result.scaling_rows = rows
        return result


def build_result(
    stats: dict[str, Stat],
    analyses: Sequence[str],
    options: GeometryOptions,
    num_layers: int,
    sequences: int,
    sink_layers: list[int] | None = None,
    scaling_nll: list[list[float]] | None = None,
    scaling_skipped: str | None = None,
    control_nll: list[list[float]] | None = None,
) -> GeometryResult:
    """Turn running statistics (and the sink-scaling NLLs per sequence, the sink's and
    the control token's) into tables."""
    ctx = TableContext(stats, options, num_layers, sink_layers, scaling_nll, scaling_skipped)
    ctx.control_nll = control_nll
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
        table = get_analysis(name).build(ctx)
        if table is not None:
            res.tables[name] = table
    return res


def split_scaling_rows(rows: list[dict[str, str]]) -> tuple[list[list[float]], list[list[float]]]:
    """The NLLs per sequence (in sequence order) and γ of the ``sink_scaling.csv`` rows:
    the sink's (``scaled`` sink, or no ``scaled``: rows written before the control), and
    the control token's (empty unless every sequence has them)."""
    sink: dict[int, list[float]] = {}
    control: dict[int, list[float]] = {}
    for row in rows:
        kept = control if row.get("scaled") == "control" else sink
        kept.setdefault(int(row["seq"]), []).append(float(row["nll"]))
    complete = set(control) == set(sink)
    return [sink[k] for k in sorted(sink)], [
        control[k] for k in sorted(control)
    ] if complete else []


def _options(config: dict[str, Any]) -> GeometryOptions:
    names = [f.name for f in fields(GeometryOptions)]
    upgraded = upgraded_config(config)  # older runs' option names
    return GeometryOptions(**{k: upgraded[k] for k in names if k in upgraded})


def _from_state(folder: Path, config: dict[str, Any], rows: list[dict[str, str]]) -> GeometryResult:
    """The tables rebuilt from the accumulator state, exactly as the run built them."""
    options = _options(config)
    state = load_state(folder / STATE_FILE)
    analyses = list(config["analyses"])
    stats = make_stats(analyses, int(state["num_layers"]), int(state["num_heads"]), options)
    for key, stat in stats.items():
        if key in state["stats"]:  # a statistic newer than the state stays empty
            stat.load_state_dict(state["stats"][key])
    nll, control = split_scaling_rows(rows)
    tables = json.loads((folder / "tables.json").read_text())
    scaling = tables.get("sink_scaling") or {}
    result = build_result(
        stats, analyses, options, int(state["num_layers"]), int(state["sequences"]),
        scaling.get("layers"), nll, scaling.get("skipped"), control,
    )  # fmt: skip
    result.state = state
    return result


def _from_tables(folder: Path, config: dict[str, Any]) -> GeometryResult:
    """The tables read back from ``tables.json`` and ``per_layer.csv`` (no state)."""
    per_layer = pd.read_csv(folder / "per_layer.csv", index_col="layer")
    meta_file = folder / "meta.json"
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    saved = SavedRun(folder, json.loads((folder / "tables.json").read_text()), per_layer)
    result = GeometryResult(
        int(meta.get("sequences", config.get("n_texts", 0))), len(per_layer),
        per_layer[["sink_rate"]],
    )  # fmt: skip
    result.analyses = list(config["analyses"])
    result.points = dict(meta.get("points", {}))
    for name in result.analyses:
        table = get_analysis(name).from_saved(saved)
        if table is not None:
            result.tables[name] = table
    return result


__all__ = [
    "JSON_KEYS",
    "SCALING_FILE",
    "STATE_FILE",
    "GeometryResult",
    "SinkScalingResult",
    "build_result",
]
