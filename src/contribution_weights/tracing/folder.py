"""Writing a trace folder so that it is never silently wrong: one writer, staged, checked.

* **One writer.** :func:`writer_lock` takes an exclusive lock on ``DIR/.cw-lock`` (an
  ``flock``, released by the kernel when the process dies, so a killed writer never
  leaves a stale lock). A second writer is refused at once with :class:`TraceFolderBusy`
  (a :class:`TraceFileError`: ``cw`` exits 2) naming the folder and the process
  that holds it. The lock is re-entrant within a process (``cw trace`` holds it across the
  trace and its figures; the trace takes it again).
* **Staged.** :func:`staged` hands out a hidden staging folder ``DIR/.partial-PID``; the
  trace is written there in full and moved into ``DIR`` only when complete. The move
  removes the earlier trace's ``meta.json`` first and puts the new one in last, so a
  writer killed at any point leaves either the earlier trace or a folder that holds no
  trace (no ``meta.json``; loading it says so), never a mix that loads. Other files in
  ``DIR`` are left alone. A staging folder left by a killed writer is removed by the next.
  A folder that already holds a trace is refused (:class:`TraceExistsError`, naming that
  trace: its tokens, layers and date) unless the writer asks to replace it
  (``overwrite=True``, ``cw trace --overwrite``).
* **Checked.** Each data file's SHA-256 is recorded in ``meta.json`` (``checksums``);
  :func:`verify` (``cw verify DIR``, ``Trace.load(DIR, verify=True)``) recomputes them and
  names every file that differs, and reading a whole layer of maps checks that layer's
  shard first (:class:`~.storage.PackedMaps`).

Standard library only (and the pure-Python ``fields``): the lock answers before torch is
imported.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..fields import int_ranges

LOCK_NAME = ".cw-lock"
STAGING_PREFIX = ".partial-"
HASH = "sha256"
_CHUNK = 1 << 24  # 16 MiB: hashing a multi-GB shard never holds more than this

_held: dict[Path, tuple[int, int]] = {}  # folder -> (fd, depth): locks this process holds


class TraceFileError(ValueError):
    """A trace folder that cannot be read: the message names the file and the problem."""


class TraceFolderBusy(TraceFileError):
    """Another process is writing the same trace folder."""


class TraceExistsError(TraceFileError):
    """The folder already holds a trace, and replacing it was not asked for."""


# ---- checksums -----------------------------------------------------------------------
def file_digest(path: str | Path) -> str:
    """``"sha256:<hex>"`` of a file, read in chunks (the same as ``sha256sum``)."""
    digest = hashlib.new(HASH)
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return f"{HASH}:{digest.hexdigest()}"


def digests(folder: Path, names: list[str]) -> dict[str, str]:
    """Digest of each file ``names`` (relative to ``folder``) that exists."""
    return {name: file_digest(folder / name) for name in names if (folder / name).is_file()}


@dataclass(frozen=True)
class Damage:
    """A trace file whose content is not what the trace wrote."""

    file: str
    problem: str

    def __str__(self) -> str:
        return f"{self.file}: {self.problem}"


def _read_meta(folder: Path) -> Any:
    try:
        return json.loads((folder / "meta.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceFileError(
            f"{folder / 'meta.json'} cannot be read ({exc}); {_no_trace_hint(folder)}"
        ) from None


def _checksums_in(meta: Any) -> dict[str, str] | None:
    sums = meta.get("checksums") if isinstance(meta, dict) else None
    return dict(sums) if isinstance(sums, dict) else None


def recorded_checksums(folder: Path) -> dict[str, str] | None:
    """The checksums in ``folder/meta.json`` (None: a trace written before they existed)."""
    return _checksums_in(_read_meta(folder))


def verify(folder: str | Path) -> list[Damage]:
    """Recompute every recorded checksum of the trace in ``folder``; the damaged files.

    Raises :class:`TraceFileError` when ``folder`` holds no trace, and when the
    trace records no checksums (written by an earlier version): nothing to check against.
    """
    folder = Path(folder)
    if not (folder / "meta.json").is_file():
        raise TraceFileError(f"{folder} holds no trace (no meta.json); {_no_trace_hint(folder)}")
    meta = _read_meta(folder)
    sums = _checksums_in(meta)
    if sums is None and not (isinstance(meta, dict) and "format" in meta):
        raise TraceFileError(
            f"{folder}/meta.json is not a trace's meta.json (no format); is it a trace folder?"
        )
    if sums is None:
        raise TraceFileError(
            f"the trace in {folder} records no checksums (it was written by an earlier "
            "version); trace the text again to be able to verify it"
        )
    damaged = []
    for name, expected in sorted(sums.items()):
        path = folder / name
        if not path.is_file():
            damaged.append(Damage(name, "missing"))
        elif (actual := file_digest(path)) != expected:
            damaged.append(Damage(name, f"checksum {actual} differs from the recorded {expected}"))
    return damaged


def check_file(path: Path, expected: str | None) -> None:
    """Raise :class:`TraceFileError` naming ``path`` when its digest is not
    ``expected`` (None: nothing recorded, nothing to check)."""
    if expected is not None and file_digest(path) != expected:
        raise TraceFileError(
            f"{path} is damaged: its checksum differs from the one recorded when the trace "
            "was written (a changed byte, a truncated copy?); trace the text again, or copy "
            "the folder again from where it was written"
        )


def _no_trace_hint(folder: Path) -> str:
    if not folder.exists():
        return "the folder does not exist; give the folder cw trace --out wrote"
    if not folder.is_dir():
        return "it is a file; give the trace's folder (what cw trace --out wrote)"
    staged = sorted(p.name for p in folder.glob(f"{STAGING_PREFIX}*"))
    if staged:
        return (
            f"a trace into it was interrupted (its partial files are in {folder / staged[0]}); "
            "trace the text again"
        )
    return "is it a trace folder?"


# ---- one writer ----------------------------------------------------------------------
def _holder(lock: Path) -> str:
    try:
        info = json.loads(lock.read_text())
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["started"]))
        return f"process {info['pid']} on {info['host']} (`{info['command']}`, since {since})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


@contextlib.contextmanager
def writer_lock(folder: str | Path) -> Iterator[Path]:
    """Hold the writer's lock of ``folder`` (created if need be, and removed again if it
    is still empty at the end) for the ``with`` block.

    Raises :class:`TraceFolderBusy` at once when another process holds it.
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise TraceFileError(f"{folder} is a file, not a folder; choose another output folder")
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    key = folder.resolve()
    if key in _held:
        fd, depth = _held[key]
        _held[key] = (fd, depth + 1)
        try:
            yield folder
        finally:
            fd, depth = _held[key]
            _held[key] = (fd, depth - 1)
        return
    lock = folder / LOCK_NAME
    fd = _acquire(folder, lock)
    try:
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": " ".join(sys.argv) or "python",
            "started": time.time(),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        _held[key] = (fd, 1)
        try:
            yield folder
        finally:
            del _held[key]
            lock.unlink(missing_ok=True)  # still held: a waiting writer re-checks the inode
    finally:
        os.close(fd)  # releases the lock
        if created:  # nothing was written (a failed run): leave no empty folder behind
            with contextlib.suppress(OSError):
                folder.rmdir()


def _acquire(folder: Path, lock: Path) -> int:
    """An open descriptor of ``lock`` holding its exclusive lock.

    The lock file is removed by its holder when done; a writer that opened it just before
    must not lock the removed file, so the lock counts only when ``lock`` still names the
    locked file (else open it again).
    """
    try:
        import fcntl
    except ImportError:  # not POSIX: no advisory locks; one writer is then the user's care
        return os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    for _ in range(100):
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise TraceFolderBusy(
                f"{folder} is being written by {_holder(lock)}; wait for it to finish, or "
                "write this trace to another folder"
            ) from None
        except OSError:  # a file system without flock (some network mounts): go on unlocked
            return fd
        try:
            if os.fstat(fd).st_ino == os.stat(lock).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # the holder removed it between our open and our lock: again
    raise TraceFolderBusy(f"{folder}: could not take the writer's lock {lock}; try again")


# ---- an earlier trace ----------------------------------------------------------------
def describe_trace(folder: str | Path) -> str | None:
    """One line naming the trace in ``folder`` (its text's first words, tokens, layers,
    model and when it was written), or None when the folder holds no trace."""
    folder = Path(folder)
    meta_path = folder / "meta.json"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        tokens = json.loads((folder / "tokens.json").read_text()).get("tokens", [])
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return f"a trace (its meta.json or tokens.json cannot be read) in {folder}"
    meta = meta if isinstance(meta, dict) else {}
    start = "".join(str(t) for t in tokens[:12]).strip().replace("\n", " ")
    if len(start) > 40 or len(tokens) > 12:
        start = start[:39].rstrip() + "…"
    layers = meta.get("layers") or []
    written = meta.get("created") or time.strftime(
        "%Y-%m-%d %H:%M UTC", time.gmtime(meta_path.stat().st_mtime)
    )
    what = f"{len(tokens)} tokens" + (f" ({start!r})" if start else "")
    where = f"layers {int_ranges(layers)}" if layers else "no layers"
    return f"{what}, {where} of {meta.get('model') or 'a model'}, written {written}"


def refuse_to_replace(folder: str | Path) -> None:
    """Raise :class:`TraceExistsError` when ``folder`` holds a trace, naming it and the
    way to replace it (a folder holding no trace, or only other files, passes)."""
    earlier = describe_trace(folder)
    if earlier is not None:
        raise TraceExistsError(
            f"{folder} already holds a trace: {earlier}. Pass --overwrite "
            "(Python: overwrite=True) to replace it, or write to another folder"
        )


# ---- staged writing ------------------------------------------------------------------
@contextlib.contextmanager
def staged(
    folder: str | Path, trace_entries: tuple[str, ...], overwrite: bool = False
) -> Iterator[Path]:
    """A staging folder to write a trace into; on leaving the block without an error its
    content replaces the trace in ``folder`` (see module docstring), else it is removed.

    ``trace_entries``: the names a trace may hold (an earlier trace's are removed even when
    the new one does not write them, so nothing of it is left to mix with the new one).
    ``overwrite``: replace a trace already in ``folder``; without it such a folder raises
    :class:`TraceExistsError` (checked under the writer's lock, before anything is written).
    """
    folder = Path(folder)
    with writer_lock(folder):
        if not overwrite:
            refuse_to_replace(folder)
        for old in folder.glob(f"{STAGING_PREFIX}*"):  # a killed writer's; we hold the lock
            shutil.rmtree(old, ignore_errors=True)
        stage = folder / f"{STAGING_PREFIX}{os.getpid()}"
        stage.mkdir()
        try:
            yield stage
            _move_in(stage, folder, trace_entries)
        finally:
            shutil.rmtree(stage, ignore_errors=True)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _move_in(stage: Path, folder: Path, trace_entries: tuple[str, ...]) -> None:
    """Replace the trace in ``folder`` by the one in ``stage``: the old ``meta.json`` goes
    first (from then on the folder holds no trace), the new one comes last."""
    _remove(folder / "meta.json")
    for name in trace_entries:
        if name != "meta.json":
            _remove(folder / name)
    new = sorted(p.name for p in stage.iterdir() if p.name != "meta.json")
    for name in new:
        os.replace(stage / name, folder / name)
    if (stage / "meta.json").exists():
        os.replace(stage / "meta.json", folder / "meta.json")
