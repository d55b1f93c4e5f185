"""A phase of an experiment (:class:`Phase`: one kind of unit of work) and its files in a
run folder: its rows (complete units only), its state (:class:`UnitState`) and its
skipped units (``skipped.jsonl``), and the data-parallel parts under ``parts/<rank>/``
merged into exactly the files a one-process run writes (:func:`consolidate`).

:func:`rows_so_far` reads a run folder's rows while the run may still be going, and
:func:`csv_bytes` writes rows as CSV. :mod:`.runner` runs the phases; nothing here
imports anything heavy.
"""

from __future__ import annotations

import csv
import json
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..runs import RunFolder

PARTS = "parts"
SKIPPED = "skipped.jsonl"


class UnitState(Protocol):
    """A state that units fold themselves into, saved after every unit and mergeable.

    ``units`` lists the units folded in; ``merge_state`` folds in another part's
    ``state_dict()`` (whose units are disjoint from ours).
    """

    units: list[int]

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def merge_state(self, state: dict[str, Any]) -> None: ...

    def reset(self) -> None: ...


@dataclass
class Phase:
    """One kind of unit of work.

    Attributes:
        name: shown on the progress bar and in ``run_info``.
        units: the unit numbers (ascending).
        run: runs one unit; returns its rows (each with ``key`` set), or None for a
            state unit; raises :class:`~.runner.SkipUnit` to skip it.
        rows_file: the CSV the rows go to (None: the phase writes no rows).
        key: the column naming the unit in ``rows_file``.
        rows_per_unit: how many rows a finished unit writes.
        state: a :class:`UnitState` the units fold into, saved to ``state_file``.
        save_state: write the state to disk after every unit (off: only at the end of
            the phase, for states too big to rewrite per unit).
    """

    name: str
    units: Sequence[int]
    run: Callable[[int], list[dict[str, Any]] | None]
    rows_file: str | None = None
    key: str = "unit"
    rows_per_unit: int = 1
    state: UnitState | None = None
    state_file: str = "state.pt"
    save_state: bool = True
    load_state: Callable[[Path], dict[str, Any] | None] | None = None
    write_state: Callable[[Path, dict[str, Any]], None] | None = None


def _parts(folder: RunFolder) -> list[RunFolder]:
    root = folder.path / PARTS
    if not root.is_dir():
        return []
    return [folder.part(f"{PARTS}/{p.name}") for p in sorted(root.iterdir()) if p.is_dir()]


def complete_rows(folder: RunFolder, phase: Phase) -> tuple[list[dict[str, str]], set[int]]:
    assert phase.rows_file is not None
    kept, keys = folder.complete_rows(phase.rows_file, phase.key, phase.rows_per_unit)
    return kept, {int(k) for k in keys}


def done_units(folder: RunFolder, phase: Phase) -> set[int]:
    done = {int(r["unit"]) for r in read_skipped(folder) if r["phase"] == phase.name}
    if phase.rows_file is not None:
        done |= complete_rows(folder, phase)[1]
    if phase.state is not None:
        state = _read_state(folder, phase)
        if state is not None:
            done |= {int(u) for u in state.get("units", [])}
    return done


def read_skipped(folder: RunFolder) -> list[dict[str, Any]]:
    return folder.read_json(SKIPPED)


def _read_state(folder: RunFolder, phase: Phase) -> dict[str, Any] | None:
    target = folder.file(phase.state_file)
    if not target.exists():
        return None
    assert phase.load_state is not None
    return phase.load_state(target)


def load_phase_state(folder: RunFolder, phase: Phase) -> None:
    assert phase.state is not None
    state = _read_state(folder, phase)
    phase.state.reset()
    if state is not None:
        phase.state.load_state_dict(state)


def save_phase_state(folder: RunFolder, phase: Phase) -> None:
    assert phase.state is not None and phase.write_state is not None
    phase.write_state(folder.file(phase.state_file), phase.state.state_dict())


def consolidate(folder: RunFolder, phase: Phase) -> None:
    """Fold every part (and the run folder's own files) into the run folder's files.

    Rows: complete units only, one copy each, sorted by unit (stable within a unit).
    States: each part whose units are not yet in the merged state is merged in. The
    merged files are written (atomically) before the parts are removed, so a crash
    here loses nothing and merges nothing twice.
    """
    parts = _parts(folder)
    for part in parts:  # a process that died mid-write may have left half a line
        part.drop_partial_lines()
    if phase.rows_file is not None:
        merged, seen = complete_rows(folder, phase)
        for part in parts:
            rows, keys = complete_rows(part, phase)
            fresh = keys - seen
            merged.extend(r for r in rows if int(r[phase.key]) in fresh)
            seen |= fresh
        if parts:
            merged.sort(key=lambda r: int(r[phase.key]))
            folder.write_bytes(phase.rows_file, csv_bytes(merged))
    if phase.state is not None and parts:
        load_phase_state(folder, phase)
        have = set(phase.state.units)
        changed = False
        for part in parts:
            state = _read_state(part, phase)
            if state is None:
                continue
            units = {int(u) for u in state.get("units", [])}
            if units and not units & have:
                phase.state.merge_state(state)
                have |= units
                changed = True
        if changed:
            save_phase_state(folder, phase)
    if parts:
        skipped = {(r["phase"], int(r["unit"])): r for r in read_skipped(folder)}
        for part in parts:
            for r in read_skipped(part):
                skipped.setdefault((r["phase"], int(r["unit"])), r)
        text = "".join(json.dumps(r) + "\n" for _, r in sorted(skipped.items()))
        folder.write_bytes(SKIPPED, text.encode())
        for part in parts:
            for name in (phase.rows_file, phase.state_file if phase.state else None, SKIPPED):
                if name is not None:
                    part.file(name).unlink(missing_ok=True)
            if not any(part.path.iterdir()):
                part.path.rmdir()
        root = folder.path / PARTS
        if root.is_dir() and not any(root.iterdir()):
            shutil.rmtree(root)


def rows_so_far(folder: Path, rows_file: str, key: str) -> list[dict[str, str]]:
    """The rows a run folder holds now, read without writing anything (the run may still be
    going): its own ``rows_file``, then each process's part under ``parts/<rank>/`` (a
    data-parallel run merges those only at its end). A unit's rows come from the first of
    those files that has it (the merged file first: a merge in progress can leave a unit in
    both), a last line still being written (no newline yet) is left out, and the rows are
    sorted by unit, as :func:`consolidate` merges them; whether a unit is complete is the
    caller's to judge."""
    import io

    paths = [folder / rows_file, *sorted((folder / PARTS).glob(f"*/{rows_file}"))]
    rows: list[dict[str, str]] = []
    taken: set[str] = set()
    for path in paths:
        if not path.is_file():
            continue
        text = path.read_text()
        text = text[: text.rfind("\n") + 1]  # a line cut mid-write (whole files end in one)
        mine = [r for r in csv.DictReader(io.StringIO(text)) if None not in r.values()]
        rows += [r for r in mine if r[key] not in taken]
        taken |= {r[key] for r in mine}
    rows.sort(key=lambda r: int(r[key]))
    return rows


def csv_bytes(rows: list[dict[str, Any]]) -> bytes:
    """Rows as CSV (a header from the first row's keys); empty for no rows."""
    import io

    buf = io.StringIO()
    if rows:
        writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return buf.getvalue().encode()
