"""A run folder's derived files rebuilt from its rows, and compared with what it holds.

A finished run folder holds its rows (``per_sequence.csv``, ``per_item.csv``, ``rows.csv``:
what the units computed) and the files derived from them when the run ended: the
summaries, the paired tests, ``tables.md``. The experiment's result type (its spec's
``result``) reads the folder back (``load``) and writes those derived files again
(``write_summary``), so every committed table can be checked against the rows it came
from, byte for byte, without the model: :func:`differences` rebuilds into a temporary
folder and names the files that differ, :func:`rebuild` rewrites them in place.

Folders of experiments without a result type (geometry, whose rows are the accumulator
state it does not commit) and folders that are not runs are passed over, and say so.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .result import CONFIG
from .spec import EXPERIMENTS


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


def experiment_of(folder: Path) -> str | None:
    """The experiment a run folder's ``config.json`` names, or None."""
    path = folder / CONFIG
    if not path.is_file():
        return None
    try:
        name = json.loads(path.read_text()).get("experiment")
    except (ValueError, AttributeError):
        return None
    return name if isinstance(name, str) else None


def run_folders(root: Path) -> list[Path]:
    """The run folders under ``root`` (itself included): those with a ``config.json``."""
    return sorted(path.parent for path in Path(root).rglob(CONFIG) if "parts" not in path.parts)


def _result_type(name: str | None) -> Any:
    if name is None or name not in EXPERIMENTS:
        return None
    return EXPERIMENTS.get(name).result_type()


def _derive(folder: Path, result_type: Any, into: Path) -> list[str]:
    """Write the derived files of ``folder``'s run into the empty folder ``into`` (which
    holds only its ``config.json``); their names."""
    result_type.load(folder).write_summary(into)
    return sorted(p.name for p in into.iterdir() if p.name != CONFIG)


def differences(folder: Path) -> Rebuilt:
    """Rebuild ``folder``'s derived files in a temporary folder and compare them."""
    name = experiment_of(folder)
    result_type = _result_type(name)
    if result_type is None:
        why = "not a run folder" if name is None else f"{name} has no result type to rebuild"
        return Rebuilt(folder, name, skipped=why)
    with tempfile.TemporaryDirectory(prefix="cw-rebuild-") as tmp:
        into = Path(tmp) / folder.name
        into.mkdir()
        shutil.copy(folder / CONFIG, into / CONFIG)
        written = _derive(folder, result_type, into)
        differing = [
            f
            for f in written
            if not (folder / f).is_file() or (folder / f).read_bytes() != (into / f).read_bytes()
        ]
    return Rebuilt(folder, name, written, differing)


def rebuild(folder: Path) -> Rebuilt:
    """Rewrite ``folder``'s derived files from its rows; which of them changed."""
    found = differences(folder)
    if found.skipped is None and found.differing:
        result_type = _result_type(found.experiment)
        result_type.load(folder).write_summary(folder)
    return found
