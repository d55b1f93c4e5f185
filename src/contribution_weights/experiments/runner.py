"""One runner for every experiment: run folder, resume, progress, run_info, data parallel.

An :class:`Experiment` says what it is (``config()``: options and a fingerprint of its
inputs), what its units of work are and what one unit yields (``phases()``: each
:class:`Phase` lists unit numbers and runs one; a unit returns CSV rows, folds itself
into a mergeable state, or raises :class:`SkipUnit` with a reason), and how finished
work summarises into a result (``result(rows, run_info)``). :func:`run_experiment`
owns the rest:

* the run folder (:class:`~..runs.RunFolder`): ``config.json``, refused resumes that
  name the differing keys, partial last lines cut;
* resume: a unit is done when all its rows (or its state) are on disk; skipped units are
  recorded in ``skipped.jsonl`` with their reason and not retried;
* progress (:func:`~..progress.bar`) and ``run_info.json`` (package versions, seconds,
  processes, units per phase, skipped units with reasons);
* data parallel: under ``accelerate launch`` (or any launcher that sets ``WORLD_SIZE``,
  ``RANK``) the units still to do are dealt round-robin over the processes; each
  process writes its own part under ``parts/<rank>/``, and the main process merges the
  parts into exactly the files a one-process run writes (rows sorted by unit; states
  folded with the experiment's ``merge_state``). Parts left by a process that died are
  merged at the start of the next ``--resume``, so no finished unit is lost.

Without a run folder (``out=None``) the same code runs in a temporary folder, one
process only.

A phase's declaration (:class:`~.phase.Phase`, :class:`~.phase.UnitState`) and its files
(complete rows, states, skipped units, the parts and their merge) are in :mod:`.phase`;
those names, :func:`~.phase.rows_so_far` and :func:`~.phase.csv_bytes` import from here
too.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from ..progress import bar
from ..runs import RunFolder
from .phase import PARTS as PARTS
from .phase import SKIPPED as SKIPPED
from .phase import Phase as Phase
from .phase import UnitState as UnitState
from .phase import (
    complete_rows,
    consolidate,
    done_units,
    load_phase_state,
    read_skipped,
    save_phase_state,
)
from .phase import csv_bytes as csv_bytes
from .phase import rows_so_far as rows_so_far

RUN_INFO = "run_info.json"
#: a running one-process session rewrites run_info.json (``finished: false``) at most this
#: often, in seconds, so that one killed outright (SIGKILL, a machine restart), which writes
#: nothing as it ends, still leaves its seconds for the resumed session to add to
INFO_EVERY = 60.0


class SkipUnit(Exception):
    """Raised by a unit that cannot run (e.g. a blank text); ``reason`` is recorded."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


R = TypeVar("R")


class Experiment(ABC, Generic[R]):
    """What a runner needs of an experiment (see the module docstring)."""

    name: str = "experiment"
    #: list-valued config keys that a resumed run may extend (entries appended: e.g.
    #: methods added to a finished run); :meth:`adopt` takes the folder's entries first
    extendable: tuple[str, ...] = ()

    @abstractmethod
    def config(self) -> dict[str, Any]:
        """What identifies the run: ``experiment``, model, options, inputs fingerprint."""

    @abstractmethod
    def phases(self) -> Iterator[Phase]:
        """The phases in order; a phase's state is merged before the next is asked for."""

    @abstractmethod
    def result(self, rows: Mapping[str, list[dict[str, str]]], run_info: dict[str, Any]) -> R:
        """The result from every phase's rows (by file name, as read back) and run_info."""

    def older_keys(self) -> dict[str, tuple[str, Any]]:
        """Config keys of older run folders: ``{old_key: (new_key, this run's value under
        the old key)}``; a folder holding ``old_key`` instead of ``new_key`` resumes when
        the values match (:meth:`~..runs.RunFolder.check`)."""
        return {}

    def adopt(self, held: dict[str, Any]) -> None:
        """Take the :attr:`extendable` entries of the config of the run being resumed
        (``held``), so that a run extended once stays extended (called before
        :meth:`config` on ``--resume``)."""


# ---- processes ---------------------------------------------------------------------------
@dataclass
class Processes:
    """This process's place among the data-parallel processes (1 of 1 without a launcher)."""

    rank: int = 0
    world: int = 1
    _state: Any = None

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self._state is not None:
            self._state.wait_for_everyone()


def processes() -> Processes:
    """The launcher's processes: ``accelerate launch`` (or ``torchrun``) sets WORLD_SIZE."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return Processes()
    import torch
    from accelerate import PartialState

    # without GPUs the processes talk over gloo (accelerate's MULTI_CPU)
    state = PartialState(cpu=not torch.cuda.is_available())
    return Processes(state.process_index, state.num_processes, state)


# ---- the runner ----------------------------------------------------------------------------
def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("contribution-weights", "torch", "transformers", "accelerate"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            continue
    return out


@dataclass
class _Files:
    """Where one process writes: the run folder itself (one process) or its part."""

    root: RunFolder
    part: RunFolder
    skipped: list[dict[str, Any]] = field(default_factory=list)


def run_experiment(
    experiment: Experiment[R],
    out: str | Path | None = None,
    *,
    resume: bool = False,
    progress: bool = True,
) -> R:
    """Run ``experiment`` into the run folder ``out`` (resumable; data parallel when
    launched with several processes) and return its result."""
    procs = processes()
    config = experiment.config()
    if out is None:
        if procs.world > 1:
            raise ValueError("a data-parallel run needs a run folder: pass out= (CLI: --out DIR)")
        with tempfile.TemporaryDirectory(
            prefix="cw-run-"
        ) as tmp:  # rows only; states stay in memory
            return _run(experiment, RunFolder(tmp, config), procs, progress, keep=False)
    # every process checks the folder (same inputs, same verdict) before any writes
    older, extendable = experiment.older_keys(), experiment.extendable
    held = RunFolder.held_config(out) if resume else None
    if held is not None and extendable:
        experiment.adopt(held)
        config = experiment.config()
    RunFolder.check(out, config, resume=resume, older=older, extendable=extendable)
    procs.barrier()
    if procs.main:  # writes config.json when new or extended
        RunFolder(out, config, resume=True, older=older, extendable=extendable)
    procs.barrier()
    return _run(experiment, RunFolder.existing(out, config), procs, progress, keep=True)


def session_info(finished: bool, earlier: float, started: float, **extra: Any) -> dict[str, Any]:
    """The fields every ``run_info.json`` starts with: versions, whether the run finished,
    and its seconds (``earlier`` sessions' plus this one's since ``started``)."""
    seconds = round(earlier + time.perf_counter() - started, 1)
    return {"versions": versions(), "finished": finished, "seconds": seconds, **extra}


def earlier_seconds(folder: RunFolder) -> float:
    """Seconds the earlier sessions of this run spent (their run_info.json), else 0."""
    path = folder.path / RUN_INFO
    try:
        return float(json.loads(path.read_text()).get("seconds", 0.0))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0.0


def _run(
    experiment: Experiment[R], folder: RunFolder, procs: Processes, progress: bool, keep: bool
) -> R:
    """Every phase, then run_info.json (whose ``seconds`` add up over resumed sessions: an
    interrupted session writes it too, with ``finished: false``, and a running one every
    :data:`INFO_EVERY` seconds, for a session killed without a chance to write it)."""
    started = time.perf_counter()
    earlier = earlier_seconds(folder) if keep else 0.0
    written: list[bool] = []  # set once the finished run_info is on disk
    try:
        return _run_phases(experiment, folder, procs, progress, keep, started, earlier, written)
    except BaseException:
        # an error while rendering the result must not replace the finished run_info
        if keep and procs.main and procs.world == 1 and not written:
            info = session_info(False, earlier, started)
            with contextlib.suppress(OSError):  # the interruption is the error to report
                folder.write_json(RUN_INFO, info)
        raise


def _run_phases(
    experiment: Experiment[R],
    folder: RunFolder,
    procs: Processes,
    progress: bool,
    keep: bool,
    started: float,
    earlier: float,
    written: list[bool],
) -> R:
    part = folder if procs.world == 1 else folder.part(f"{PARTS}/{procs.rank}")
    files = _Files(folder, part)
    counts: dict[str, int] = {}
    rows: dict[str, list[dict[str, str]]] = {}
    noted = started  # when run_info.json was last rewritten mid-run
    for phase in experiment.phases():
        if procs.main:
            consolidate(folder, phase)
        procs.barrier()
        done = done_units(folder, phase)
        todo = [u for u in phase.units if u not in done]
        mine = todo[procs.rank :: procs.world]
        if phase.state is not None:
            if procs.world == 1 and keep:
                load_phase_state(folder, phase)
            else:
                phase.state.reset()
        bar_ = bar(
            total=len(mine) if procs.world > 1 else len(phase.units),
            initial=0 if procs.world > 1 else len(phase.units) - len(todo),
            desc=phase.name if procs.world == 1 else f"{phase.name} [{procs.rank}/{procs.world}]",
            unit="unit",
            disable=not progress or not procs.main,
        )
        try:
            for unit in mine:
                _run_unit(files, phase, unit, keep)
                bar_.update(1)
                if keep and procs.world == 1 and time.perf_counter() - noted >= INFO_EVERY:
                    folder.write_json(RUN_INFO, session_info(False, earlier, started))
                    noted = time.perf_counter()
        finally:
            bar_.close()
            if phase.state is not None and not phase.save_state and keep:
                save_phase_state(part, phase)
        procs.barrier()
        if procs.main:
            consolidate(folder, phase)
        procs.barrier()
        if phase.state is not None and keep:
            load_phase_state(folder, phase)  # every process sees the merged state
        counts[phase.name] = len(phase.units)
        if phase.rows_file is not None:
            rows[phase.rows_file] = complete_rows(folder, phase)[0]
    skipped = sorted(read_skipped(folder), key=lambda r: (r["phase"], r["unit"]))
    run_info = session_info(
        True, earlier, started, processes=procs.world, units=counts, skipped=skipped
    )
    if keep and procs.main:
        folder.write_json(RUN_INFO, run_info)
        written.append(True)
    result = experiment.result(rows, run_info)
    if keep and procs.main:
        save = getattr(result, "write_summary", None)
        if save is not None:
            save(folder.path)
    procs.barrier()
    return result


def _run_unit(files: _Files, phase: Phase, unit: int, keep: bool = True) -> None:
    try:
        out = phase.run(unit)
    except SkipUnit as skip:
        record = {"phase": phase.name, "unit": unit, "reason": skip.reason}
        files.part.append_json(SKIPPED, record)
        return
    if phase.rows_file is not None and out:
        files.part.append_rows(phase.rows_file, out)
    if phase.state is not None and phase.save_state and keep:
        save_phase_state(files.part, phase)


def resume_hint(argv: Sequence[str]) -> str:
    """The command that resumes an interrupted ``cw`` run (adds ``--resume``; with the
    ``CW_PLUGINS`` it ran with, whose modules may define the command or its choices)."""
    import os
    import shlex

    args = list(argv)
    if "--resume" not in args:
        args.append("--resume")
    plugins = os.environ.get("CW_PLUGINS", "").strip()
    prefix = f"CW_PLUGINS={shlex.quote(plugins)} " if plugins else ""
    return prefix + "cw " + shlex.join(args)
