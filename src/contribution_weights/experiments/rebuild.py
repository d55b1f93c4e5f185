"""A run folder's derived files rebuilt from its rows, and compared with what it holds.

A finished run folder holds its rows (``per_sequence.csv``, ``per_item.csv``, ``rows.csv``:
what the units computed) and the files derived from them when the run ended: the
summaries, the paired tests, ``tables.md``. The experiment's result type (its spec's
``result``) reads the folder back (``load``) and writes those derived files again
(``write_summary``), so every committed table can be checked against the rows it came
from, byte for byte, without the model: :func:`differences` rebuilds into a temporary
folder and names the files that differ, :func:`rebuild` rewrites them in place. Figures
are drawn by the presentation layer, which ``cw results`` hands in (``draw``).

Geometry's rows are an accumulator state (``state.pt``) too large to commit: its folders
are rebuilt from the tables that state gave (``tables.json``), which checks every file
drawn from them (``tables.md``, ``per_layer.csv``, the figures). Folders of experiments
without a result type and folders that are not runs are passed over, and say so.
"""

from __future__ import annotations

import importlib
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .result import CONFIG
from .spec import EXPERIMENTS

#: draws a loaded result's figures into a folder (the presentation layer's, handed in by
#: ``cw results``: this layer draws nothing)
Draw = Callable[[str, Any, Path], None]


@dataclass
class Rebuilt:
    """What rebuilding one run folder gave."""

    folder: Path
    experiment: str | None
    written: list[str] = field(default_factory=list)  # the derived files, by name
    differing: list[str] = field(default_factory=list)  # those that differ from the folder's
    skipped: str | None = None  # why the folder was passed over

    @property
    def same(self) -> bool:
        return self.skipped is None and not self.differing


class RebuildError(ValueError):
    """A run folder that cannot be read back (its config, or its rows)."""


def experiment_of(folder: Path) -> str | None:
    """The experiment a run folder's ``config.json`` names, or None when it has none; a
    config that cannot be read is a :class:`RebuildError` naming it."""
    path = folder / CONFIG
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except ValueError as err:
        raise RebuildError(f"{path} is not valid JSON ({err}); restore it from git") from err
    name = config.get("experiment") if isinstance(config, dict) else None
    if not isinstance(name, str):
        raise RebuildError(f"{path} names no experiment; restore it from git")
    return name


def run_folders(root: Path) -> list[Path]:
    """The run folders under ``root`` (itself included): those with a ``config.json``,
    but not the per-process parts a data-parallel run merged."""
    root = Path(root)
    return sorted(
        path.parent for path in root.rglob(CONFIG) if "parts" not in path.relative_to(root).parts
    )


#: result types of experiments with a command of their own instead of an ExperimentSpec
OTHER_RESULTS = {"geometry": "contribution_weights.experiments.geometry.result:GeometryResult"}


def _result_type(name: str | None) -> Any:
    if name in OTHER_RESULTS:
        module, _, attr = OTHER_RESULTS[name].partition(":")
        return getattr(importlib.import_module(module), attr)
    if name is None or name not in EXPERIMENTS:
        return None
    return EXPERIMENTS.get(name).result_type()


def _derive(folder: Path, name: str, result_type: Any, into: Path, draw: Draw | None) -> list[str]:
    """Write the derived files (and with ``draw`` the figures) of ``folder``'s run into the
    empty folder ``into`` (which holds only its ``config.json``); their names."""
    result = result_type.load(folder)
    result.write_summary(into)
    if draw is not None:
        draw(name, result, into)
    return sorted(p.name for p in into.iterdir() if p.name != CONFIG)


def differences(folder: Path, draw: Draw | None = None) -> Rebuilt:
    """Rebuild ``folder``'s derived files (and figures, with ``draw``) in a temporary
    folder and compare them with the folder's; nothing in ``folder`` changes."""
    return _rebuilt(folder, draw, write=False)


def rebuild(folder: Path, draw: Draw | None = None) -> Rebuilt:
    """Rewrite ``folder``'s derived files (and figures, with ``draw``) that differ from what
    its rows give; which they were."""
    return _rebuilt(folder, draw, write=True)


def _rebuilt(folder: Path, draw: Draw | None, write: bool) -> Rebuilt:
    name = experiment_of(folder)
    result_type = _result_type(name)
    if name is None or result_type is None:
        why = "not a run folder" if name is None else f"{name} has no result type to rebuild"
        return Rebuilt(folder, name, skipped=why)
    with tempfile.TemporaryDirectory(prefix="cw-rebuild-") as tmp:
        into = Path(tmp) / folder.name
        into.mkdir()
        shutil.copy(folder / CONFIG, into / CONFIG)
        try:
            written = _derive(folder, name, result_type, into, draw)
        except Exception as err:  # a folder whose rows do not load: named, not a traceback
            raise RebuildError(
                f"{folder}: its {name} result could not be rebuilt from its rows "
                f"({type(err).__name__}: {err})"
            ) from err
        differing = [
            f
            for f in written
            if not (folder / f).is_file() or (folder / f).read_bytes() != (into / f).read_bytes()
        ]
        if write:
            for f in differing:
                shutil.copy(into / f, folder / f)
    return Rebuilt(folder, name, written, differing)
