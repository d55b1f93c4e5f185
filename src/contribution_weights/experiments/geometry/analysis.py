"""What a geometry analysis is, and the registry that finds one by name.

An :class:`Analysis` holds everything about one analysis: the running statistics it
needs (:meth:`~Analysis.stats`, shared by name), how they become its table
(:meth:`~Analysis.build`), its ``tables.json`` entries (:meth:`~Analysis.to_json`) and how
a run folder without its state gives the table back (:meth:`~Analysis.from_saved`), its
columns of ``per_layer.csv`` and other files, and its section of ``tables.md``
(:meth:`~Analysis.markdown`). Its figure belongs to the presentation layer, registered
there by the analysis' name (``presentation.geometry_plots.register_geometry_figure``).
Register an instance with :func:`register_analysis` and ``cw geometry --only NAME`` runs
it; the built-in ones live in :mod:`.analyses`, one module each.

Also here: the helpers analyses share to write JSON numbers and Markdown tables. The types
they share with :mod:`.result` (:class:`~.analysis_types.TableContext`, ``SavedRun``,
``ResultView``) live in :mod:`.analysis_types`, which imports neither.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import fields
from typing import Any, Generic, TypeVar, cast

import numpy as np
import pandas as pd

from ...registry import Registry
from ..options import GeometryOptions
from ..stats import ComponentPoints, LayerMeans, SinkRate, Stat
from .analysis_types import ResultView, SavedRun, TableContext

T = TypeVar("T")


class Analysis(Generic[T]):
    """One geometry analysis, everything about it in one class; ``T`` is its table's type.

    ``stats`` names the running statistics it needs (shared by name: two analyses asking
    for ``"points"`` share one sample); ``build`` turns them into its table, kept in
    ``result.tables[name]``; ``to_json`` gives its entries of ``tables.json`` and
    ``from_saved`` the table back from them (for run folders published without their
    state); ``per_layer`` its columns of ``per_layer.csv``, ``files`` any other file it
    writes; ``markdown`` its section of ``tables.md``. ``result.<attribute>`` reads
    :meth:`attribute` of the table for each name in :attr:`attributes` (default: the
    table itself, as ``result.<name>``).
    """

    name: str = ""
    aliases: tuple[str, ...] = ()
    json_keys: tuple[str, ...] = ()  # its keys in tables.json; default (name,)
    attributes: tuple[str, ...] = ()  # what it answers as result.<attribute>; default (name,)

    def stats(self, num_layers: int, num_heads: int, options: GeometryOptions) -> dict[str, Stat]:
        return {}

    def build(self, ctx: TableContext) -> T | None:
        """This analysis' table (None: nothing to show, e.g. passes that did not run)."""
        return None

    def to_json(self, table: T) -> dict[str, Any]:
        return {}

    def from_saved(self, saved: SavedRun) -> T | None:
        """The table rebuilt from a run folder's saved tables (None: it cannot be)."""
        return None

    def per_layer(self, table: T) -> pd.DataFrame | None:
        """Columns of ``per_layer.csv`` (indexed by layer), or None."""
        return None

    def files(self, table: T) -> dict[str, bytes]:
        """Other files of the run folder, by name."""
        return {}

    def markdown(self, table: T, result: ResultView) -> list[str]:
        """Lines of this analysis' section of ``tables.md``."""
        return []

    def attribute(self, table: T, name: str) -> Any:
        """``result.<name>`` for one of :attr:`attributes` (the table itself by default)."""
        return getattr(table, name) if self.attributes else table

    def json_entries(self) -> tuple[str, ...]:
        return self.json_keys or (self.name,)

    def attribute_names(self) -> tuple[str, ...]:
        return self.attributes or (self.name,)


class LayerMeansAnalysis(Analysis[T]):
    """An analysis whose table is one per-layer mean statistic (:attr:`stat`, a
    :class:`~..stats.LayerMeans` kept under the analysis' name), as a frame indexed by
    layer with the statistic's columns, written to ``per_layer.csv`` as :attr:`prefix`
    followed by each column's name.

    ``stats``, ``build``, ``from_saved`` and ``per_layer`` follow from :attr:`stat` and
    :attr:`prefix`; a table that is more than that frame is a dataclass made from the
    frame alone, its first field (:attr:`tables`), or says how it is made from the frame
    (:meth:`table_from_layers`) and which frame it holds (:meth:`layers_of`).
    """

    stat: type[LayerMeans]
    #: before each column's name in per_layer.csv; None: the analysis' name and ``:``
    prefix: str | None = None
    #: the table's type when it is more than the frame: a dataclass made from the frame
    #: alone (``tables(by_layer)``), which is its first field; None: the frame itself.
    #: Its :attr:`attributes` default to the name and that first field.
    tables: type[Any] | None = None

    @property
    def column_prefix(self) -> str:
        return f"{self.name}:" if self.prefix is None else self.prefix

    def attribute(self, table: T, name: str) -> Any:
        return super().attribute(table, name) if self.tables is None else getattr(table, name)

    def attribute_names(self) -> tuple[str, ...]:
        if self.attributes or self.tables is None:
            return super().attribute_names()
        return (self.name, fields(self.tables)[0].name)

    def stats(self, num_layers: int, num_heads: int, options: GeometryOptions) -> dict[str, Stat]:
        return {self.name: self.stat(num_layers)}

    def table_from_layers(self, by_layer: pd.DataFrame) -> T:
        """The table of the per-layer frame (default: :attr:`tables` of it, or the frame)."""
        return cast(T, by_layer if self.tables is None else self.tables(by_layer))

    def layers_of(self, table: T) -> pd.DataFrame:
        """The per-layer frame a table holds (default: the first field of a :attr:`tables`
        table, or the table itself)."""
        if self.tables is None:
            return cast(pd.DataFrame, table)
        return cast(pd.DataFrame, getattr(table, fields(self.tables)[0].name))

    def build(self, ctx: TableContext) -> T:
        stat = ctx.stats[self.name]
        assert isinstance(stat, LayerMeans)
        return self.table_from_layers(pd.DataFrame(stat.by_layer(), ctx.layers, list(stat.columns)))

    def from_saved(self, saved: SavedRun) -> T | None:
        columns = [self.column_prefix + c for c in self.stat.columns]
        if not set(columns) <= set(saved.per_layer.columns):
            return None
        by_layer = saved.per_layer[columns].rename(
            columns=lambda c: str(c)[len(self.column_prefix) :]
        )
        return self.table_from_layers(by_layer)

    def per_layer(self, table: T) -> pd.DataFrame:
        return self.layers_of(table).add_prefix(self.column_prefix)


ANALYSES_REGISTRY: Registry[Analysis[Any]] = Registry("analysis", plural="analyses")


def register_analysis(analysis: Analysis[Any]) -> Analysis[Any]:
    """Add (or replace) an analysis by its name; returns it."""
    return ANALYSES_REGISTRY.register(analysis)


def get_analysis(name: str) -> Analysis[Any]:
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


# ---- JSON numbers and Markdown tables, shared by the analyses -------------------------------
def num(x: Any) -> Any:
    """A number for JSON: bools and ints as such, NaN and infinities as None."""
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    x = float(x)
    return None if math.isnan(x) or math.isinf(x) else x


def records(t: pd.DataFrame) -> list[dict[str, Any]]:
    """One dict per row (JSON numbers)."""
    return [{str(k): num(v) for k, v in row.items()} for row in t.to_dict("records")]


def nested(t: pd.DataFrame) -> dict[str, dict[str, Any]]:
    """``{column: {index: value}}`` (JSON numbers)."""
    return {str(c): {str(i): num(t.loc[i, c]) for i in t.index} for c in t.columns}


def from_nested(d: dict[str, dict[str, Any]], index_name: str | None = None) -> pd.DataFrame:
    """Inverse of :func:`nested` (None back to NaN)."""
    t = pd.DataFrame(d).rename_axis(index_name)
    return t.apply(lambda c: c.astype(float) if c.dtype == object else c)


def _cell(x: Any) -> str:
    if isinstance(x, (bool, np.bool_)):
        return str(bool(x))
    if isinstance(x, (float, np.floating)):
        return "n/a" if np.isnan(x) else f"{x:.3f}"
    return str(x)


def markdown_table(t: pd.DataFrame, index: bool = True) -> str:
    """A DataFrame as a Markdown table (3 decimals), without optional dependencies."""
    head = ([str(t.index.name or "")] if index else []) + [str(c) for c in t.columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in t.itertuples(index=True, name=None):  # keeps each column's type
        key, values = row[0], row[1:]
        cells = ([_cell(key)] if index else []) + [_cell(v) for v in values]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sampled_points(num_layers: int, options: GeometryOptions) -> dict[str, Stat]:
    """The shared sample of (α, r, κ, ĉ, ‖ṽ‖) points, ``"points"`` (its cap and seed)."""
    return {"points": ComponentPoints(num_layers, options.cap, options.seed)}


# ---- a permutation null beside an analysis' table: tables.json, read back, tables.md ------
def null_to_json(null: pd.DataFrame, overall: str, token: str, alternative: str) -> dict[str, Any]:
    """The ``null`` entry of an analysis in ``tables.json``: what stands in for the sink
    (``token``), the side of its one-sided p-values, its row ``overall`` (over layers)
    and its rows per layer."""
    return {
        "token": token,
        "alternative": alternative,
        "overall": records(null[null.index == overall])[0],
        "by_layer": records(null[null.index != overall].reset_index()),
    }


def null_from_json(data: dict[str, Any], overall: str, columns: Sequence[str]) -> pd.DataFrame:
    """Inverse of :func:`null_to_json`: the null's table, indexed by layer and ``overall``."""
    null = pd.DataFrame([*data["by_layer"], {"layer": overall, **data["overall"]}])
    null = null.set_index("layer")
    null.index = pd.Index(null.index, dtype=object, name="layer")
    return null.reindex(columns=list(columns)).astype(float)


def null_markdown(
    null: pd.DataFrame | None, overall: str, about: Callable[[pd.Series], str]
) -> list[str]:
    """The lines of ``tables.md`` after an analysis' table for its null: none without one,
    else ``about`` its row ``overall`` and the null's table."""
    if null is None:
        return []
    return [about(null.loc[overall]), "", markdown_table(null), ""]
