"""The types that the analyses, :mod:`.analysis` and :mod:`.result` share, in a module that
imports none of them (so none of them imports another for a type):

* :class:`TableContext`, what an analysis builds its table from;
* :class:`SavedRun`, what a run folder keeps besides its state;
* :class:`ResultView`, what an analysis reads of the result it writes its section of
  ``tables.md`` for (a :class:`~.result.GeometryResult` is one).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pandas as pd

from ..options import GeometryOptions
from ..stats import Stat


@dataclass
class TableContext:
    """What an analysis builds its table from: the run's statistics and its scaling passes."""

    stats: dict[str, Stat]
    options: GeometryOptions
    num_layers: int
    sink_layers: list[int] | None = None
    scaling_nll: list[list[float]] | None = None
    scaling_skipped: str | None = None
    groups: dict[str, dict[str, np.ndarray]] | None = None  # the sampled points per group
    control_nll: list[list[float]] | None = None  # the scaling passes' control, per sequence

    @property
    def layers(self) -> pd.RangeIndex:
        return pd.RangeIndex(self.num_layers, name="layer")


@dataclass
class SavedRun:
    """What a run folder keeps besides its state: ``tables.json`` and ``per_layer.csv``
    (indexed by layer), read back when the state (``state.pt``) is not there."""

    folder: Path
    tables: dict[str, Any]
    per_layer: pd.DataFrame


class ResultView(Protocol):
    """What an analysis' :meth:`~.analysis.Analysis.markdown` may read of the run's result
    (:class:`~.result.GeometryResult`): the texts and layers, the sink rate per layer,
    every analysis' table by name, the sampled points per group, the analyses that ran
    and the run's config."""

    @property
    def sequences(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def sink_rate(self) -> pd.DataFrame: ...
    @property
    def tables(self) -> dict[str, Any]: ...
    @property
    def points(self) -> dict[str, int]: ...
    @property
    def analyses(self) -> list[str]: ...
    @property
    def config(self) -> dict[str, Any]: ...
