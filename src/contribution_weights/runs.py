"""Resumable run folders for long experiments (faithfulness, geometry, downstream, kv-eval).

A run folder holds ``config.json`` (what was asked) and append-only CSV/JSONL files of
finished units of work. Each finished unit is appended in one write followed by
``fsync``; a unit that needs several rows may still span more than one OS write, so on
resume :meth:`RunFolder.complete_rows` keeps only the units with all their rows (dropping
a partly written one, which is then redone) and the experiment skips those. Resuming
with a different config is refused, naming the keys that differ, so results never mix silently.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def fingerprint(items: Iterable[Any], *, algorithm: str = "sha256") -> str:
    """A short hex digest of the inputs of a run, stored in its config so that resuming
    with other inputs is refused.

    Each item is a string (hashed as is) or a JSON-able value (hashed as sorted JSON);
    items are separated by a NUL byte. Every experiment stores it as ``texts_sha256``;
    ``algorithm`` is any :mod:`hashlib` name (faithfulness folders written before that
    hold a sha1 one as ``texts_sha1``, and still resume).
    """
    digest = hashlib.new(algorithm)
    for item in items:
        text = item if isinstance(item, str) else json.dumps(item, sort_keys=True)
        digest.update(text.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


#: config keys recorded for people, not compared on resume (the texts are compared by content)
INFORMATIONAL = ("source",)
#: options renamed since older run folders were written: experiment -> {old: new}
RENAMED = {
    "faithfulness": {"sink_threshold": "sink_cosine"},
    "downstream": {"sink_threshold": "sink_cosine"},
    "geometry": {"sink_threshold": "sink_layer_threshold"},
}


def renamed_keyword(experiment: str, old: str, old_value: T | None, value: T) -> T:
    """``value``, or ``old_value`` when the caller of the entry point ``experiment()``
    gave it under the option's older name ``old`` (:data:`RENAMED`), then with a
    :class:`DeprecationWarning` that names the new one (pointing at that caller)."""
    if old_value is None:
        return value
    warnings.warn(
        f"{experiment}({old}=) is deprecated; use {RENAMED[experiment][old]}=",
        DeprecationWarning,
        stacklevel=3,
    )
    return old_value


#: options added since older run folders were written, with the value those runs used:
#: experiment -> {key: value}
ADDED: dict[str, dict[str, Any]] = {
    "faithfulness": {"intervention": "value_zero", "baselines": [], "random_seeds": 3},
    "downstream": {"intervention": "value_zero", "baselines": [], "random_seeds": 3},
    "kv-eval": {"ruler_tasks": "all", "settings": ["query_agnostic"]},
    "attribution-eval": {"added_methods": [], "generator": "words"},
}


def upgraded_config(config: dict[str, Any]) -> dict[str, Any]:
    """An older run's config with renamed options under their new names and options added
    since at the value the run used."""
    experiment = str(config.get("experiment"))
    renames = RENAMED.get(experiment, {})
    upgraded = {renames.get(k, k): v for k, v in config.items()}
    return {**ADDED.get(experiment, {}), **upgraded}


class RunFolderError(RuntimeError):
    """A run folder cannot be (re)used as asked."""


def holds_run(path: str | Path, resume: bool, flag: str = "resume=True (CLI: --resume)") -> bool:
    """Whether ``path`` holds a run (its ``config.json``), which only ``resume`` may reuse:
    without it such a folder is refused (:class:`RunFolderError`), ``flag`` naming the
    option to pass. Reads nothing else, so the command line asks it before the model
    loads; whether the run's options match is :meth:`RunFolder.check`'s."""
    held = (Path(path) / "config.json").exists()
    if held and not resume:
        raise RunFolderError(
            f"{path} already holds a run; pass {flag} to continue it, or choose another "
            "--out folder"
        )
    return held


class RunFolder:
    """A folder of one experiment run."""

    def __init__(
        self,
        path: str | Path,
        config: Mapping[str, Any],
        resume: bool = False,
        older: Mapping[str, tuple[str, Any]] | None = None,
        extendable: Sequence[str] = (),
    ):
        self.path = Path(path)
        self.config = dict(config)
        cfg_file = self.path / "config.json"
        if cfg_file.exists():
            held = RunFolder.check(self.path, self.config, resume, older, extendable) or {}
            if any(held.get(k) != self.config.get(k) for k in extendable):
                self.write_json("config.json", self.config, indent_sort=True)  # extended
            self.drop_partial_lines()
        else:
            self.path.mkdir(parents=True, exist_ok=True)
            self.write_json("config.json", self.config, indent_sort=True)

    @staticmethod
    def check(
        path: str | Path,
        config: Mapping[str, Any],
        resume: bool = False,
        older: Mapping[str, tuple[str, Any]] | None = None,
        extendable: Sequence[str] = (),
    ) -> dict[str, Any] | None:
        """Refuse (with :class:`RunFolderError`) to reuse ``path`` for ``config``, reading only;
        returns the folder's config (None where it holds no run).

        A folder holding a run needs ``resume``, and then the same config: the keys that
        differ are named. Keys in :data:`INFORMATIONAL` (where the texts came from, as
        spelled) are not compared: the inputs are compared by their content's fingerprint.
        ``older`` maps a key older folders hold to ``(the key it became, this run's value
        under the old key)``, so a folder written before the rename still resumes. A key in
        ``extendable`` (a list) may have grown: the folder's list must be where the new
        one starts (what a run adds later, such as methods added to a finished run).
        """
        path = Path(path)
        if not holds_run(path, resume):
            return None
        old = RunFolder.held_config(path) or {}
        config = dict(config)
        for old_key, (new_key, value) in (older or {}).items():
            if old_key in old and new_key not in old:
                config[old_key] = value
                config.pop(new_key, None)
        diff = sorted(
            k
            for k in set(old) | set(config)
            if k not in INFORMATIONAL
            and old.get(k) != config.get(k)
            and not (k in extendable and _extends(config.get(k), old.get(k)))
        )
        if diff:
            shown = "; ".join(
                f"{k}: {_short(old.get(k))} in the folder, {_short(config.get(k))} now"
                for k in diff[:3]
            )
            more = f" (and {len(diff) - 3} more)" if len(diff) > 3 else ""
            raise RunFolderError(
                f"cannot resume {path}: its config differs in {', '.join(diff)} ({shown}"
                f"{more}); rerun with the same options or choose another --out folder"
            )
        return old

    @staticmethod
    def held_config(path: str | Path) -> dict[str, Any] | None:
        """The config of the run ``path`` holds (older option names upgraded), or None."""
        target = Path(path) / "config.json"
        if not target.is_file():
            return None
        return upgraded_config(json.loads(target.read_text()))

    @classmethod
    def existing(cls, path: str | Path, config: Mapping[str, Any]) -> RunFolder:
        """A folder already set up (config written and checked), opened without writing."""
        folder = cls.__new__(cls)
        folder.path = Path(path)
        folder.config = dict(config)
        return folder

    def drop_partial_lines(self) -> None:
        """Cut a last line a crash left without its newline from every CSV/JSONL file."""
        for partial in [*self.path.glob("*.csv"), *self.path.glob("*.jsonl")]:
            _drop_partial_last_line(partial)

    def part(self, name: str) -> RunFolder:
        """A sub-folder written like a run folder (no config; made on first write)."""
        return RunFolder.existing(self.path / name, self.config)

    def file(self, name: str) -> Path:
        return self.path / name

    def append_rows(self, name: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """Append rows to a CSV in one write (header written when the file is new)."""
        if not rows:
            return
        target = self.file(name)
        fields = list(rows[0].keys())
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
        if not target.exists() or target.stat().st_size == 0:
            writer.writeheader()
        writer.writerows(rows)
        _append(target, buf.getvalue())

    def read_rows(self, name: str) -> list[dict[str, str]]:
        target = self.file(name)
        if not target.exists():
            return []
        with target.open(newline="") as fh:
            return [row for row in csv.DictReader(fh) if None not in row.values()]

    def append_json(self, name: str, record: Mapping[str, Any]) -> None:
        """Append one JSON record (one line) to a JSONL file."""
        _append(self.file(name), json.dumps(record) + "\n")

    def read_json(self, name: str) -> list[dict[str, Any]]:
        target = self.file(name)
        if not target.exists():
            return []
        out = []
        for line in target.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a crash mid-write
                continue
        return out

    def done_keys(self, name: str, key_fields: Iterable[str]) -> set[tuple[str, ...]]:
        """Keys (as strings) of the rows already in a CSV file."""
        fields = list(key_fields)
        return {tuple(row[f] for f in fields) for row in self.read_rows(name)}

    def complete_rows(
        self, name: str, key_field: str, size: int
    ) -> tuple[list[dict[str, str]], set[str]]:
        """Rows of the units that wrote all their ``size`` rows, and those units' keys.

        One unit's rows can take more than one OS write, so a crash can leave only some
        of them: the CSV is rewritten (atomically) without such incomplete units, which
        the experiment then redoes from scratch.
        """
        rows = self.read_rows(name)
        counts: dict[str, int] = {}
        for row in rows:
            counts[row[key_field]] = counts.get(row[key_field], 0) + 1
        done = {k for k, n in counts.items() if n == size}
        kept = [row for row in rows if row[key_field] in done]
        if len(kept) != len(rows):
            buf = io.StringIO()
            if kept:
                writer = csv.DictWriter(buf, fieldnames=list(kept[0]), lineterminator="\n")
                writer.writeheader()
                writer.writerows(kept)
            self.write_bytes(name, buf.getvalue().encode())
        return kept, done

    def write_json(self, name: str, data: Any, indent_sort: bool = False) -> Path:
        """Write a JSON file atomically (write to a temporary file, then rename)."""
        return self.write_bytes(name, json.dumps(data, indent=2, sort_keys=indent_sort).encode())

    def write_bytes(self, name: str, data: bytes) -> Path:
        """Replace a file atomically and durably (temporary file, fsync, rename)."""
        target = self.file(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        # plain open(): the file gets the usual 0666 & ~umask (0644), unlike mkstemp's 0600
        with tmp.open("wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
        return target


def _append(target: Path, text: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("a") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def _drop_partial_last_line(target: Path) -> None:
    """Cut a last line left without its newline by a crash mid-write."""
    data = target.read_bytes()
    if data and not data.endswith(b"\n"):
        target.write_bytes(data[: data.rfind(b"\n") + 1])


def _extends(new: Any, old: Any) -> bool:
    """Whether the list ``new`` is the list ``old`` with entries appended (or the same)."""
    old = [] if old is None else old
    return isinstance(new, list) and isinstance(old, list) and new[: len(old)] == old


def _short(value: Any, width: int = 60) -> str:
    """A config value as an error message shows it: JSON, cut to ``width`` characters."""
    text = json.dumps(value)
    return text if len(text) <= width else text[: width - 1] + "…"
