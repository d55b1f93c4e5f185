"""What every experiment's result shares: its config, its run_info, symmetric save/load.

``result.save(folder)`` writes ``config.json``, ``run_info.json`` and the experiment's
own files (:meth:`ExperimentResult.write_files`); ``Result.load(folder)`` reads exactly
those back (:meth:`ExperimentResult.from_files`), so ``load(save(x))`` equals ``x``. A
run folder written by :func:`~.runner.run_experiment` holds the same files, so it loads
the same way.
"""

from __future__ import annotations

import csv
import json
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import pandas as pd

CONFIG = "config.json"
RUN_INFO = "run_info.json"
SUMMARY = "summary.csv"

T = TypeVar("T", bound="ExperimentResult")
R = TypeVar("R", bound="RowsResult")


class FewSamplesWarning(UserWarning):
    """An experiment got a single text or item: the standard errors over texts or items
    (and the figures' error bars) need at least two."""


def warn_few_samples(n: int, what: str, columns: str, stacklevel: int = 3) -> None:
    """Warn (:class:`FewSamplesWarning`) when ``n`` is 1: ``what`` names the units
    ("text", "item"), ``columns`` the summary's standard-error columns."""
    if n == 1:
        warnings.warn(
            FewSamplesWarning(
                f"only 1 {what}: standard errors over {what}s ({columns}) and the figure's "
                "error bars cannot be computed from one, so the summary leaves them blank "
                f"(NaN) or 0; give 2 or more {what}s"
            ),
            stacklevel=stacklevel,
        )


@contextmanager
def few_samples_on_stderr(command: str, hint: str) -> Iterator[None]:
    """Within the block, a :class:`FewSamplesWarning` is printed as one line on stderr,
    ``cw <command>: warning: <message> (<hint>)``, where ``hint`` names the command's
    options that give more texts or items; other warnings are shown as usual."""
    with warnings.catch_warnings():
        warnings.simplefilter("always", FewSamplesWarning)
        show = warnings.showwarning

        def show_few(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
            if issubclass(category, FewSamplesWarning):
                print(f"cw {command}: warning: {message} ({hint})", file=sys.stderr, flush=True)
            else:
                show(message, category, *args, **kwargs)

        warnings.showwarning = show_few
        yield


class ExperimentResult:
    """Base of the experiments' results."""

    def __init__(self, config: dict[str, Any], run_info: dict[str, Any] | None = None) -> None:
        self.config = dict(config)
        self.run_info: dict[str, Any] = dict(run_info or {})

    @property
    def skipped(self) -> list[dict[str, Any]]:
        """Units that were skipped, each ``{"phase", "unit", "reason"}``."""
        return list(self.run_info.get("skipped", []))

    @property
    def seconds(self) -> float | None:
        return self.run_info.get("seconds")

    def write_files(self, folder: Path) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    @classmethod
    def from_files(
        cls: type[T], folder: Path, config: dict[str, Any], run_info: dict[str, Any]
    ) -> T:  # pragma: no cover - overridden
        raise NotImplementedError

    def save(self, folder: str | Path) -> Path:
        """Write config.json, run_info.json and the result's files into ``folder``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / CONFIG).write_text(json.dumps(self.config, indent=2, sort_keys=True))
        (folder / RUN_INFO).write_text(json.dumps(self.run_info, indent=2))
        self.write_files(folder)
        return folder

    @classmethod
    def load(cls: type[T], folder: str | Path) -> T:
        """Read a result written by :meth:`save` (or by a run into that folder)."""
        folder = Path(folder)
        config_file = folder / CONFIG
        if not config_file.is_file():
            raise FileNotFoundError(
                f"{folder} holds no {CONFIG}; pass a folder written by result.save() or by a run"
            )
        config = json.loads(config_file.read_text())
        info_file = folder / RUN_INFO
        run_info = json.loads(info_file.read_text()) if info_file.is_file() else {}
        return cls.from_files(folder, config, run_info)


class RowsResult(ExperimentResult):
    """A result that is one table of rows (:attr:`ROWS`: the runner's rows file, one or
    more rows per unit) and the summary computed from them (``summary.csv``).

    A subclass names :attr:`ROWS`, types the rows (:meth:`frame`: as computed, or as read
    back from the CSV as strings) and summarises them (:meth:`summarise_rows`); the
    constructor, :meth:`write_files`, :meth:`from_files`, :meth:`from_rows` (the
    experiment's rows at the end of a run) and :meth:`write_summary` (the runner's hook
    when a run ends) are shared.
    """

    ROWS: ClassVar[str] = ""

    def __init__(
        self,
        rows: pd.DataFrame,
        config: dict[str, Any],
        run_info: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(config, run_info)
        self.rows = rows
        self.summary = self.summarise_rows()

    def summarise_rows(self) -> pd.DataFrame:  # pragma: no cover - overridden
        raise NotImplementedError

    @classmethod
    def frame(cls, rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:  # pragma: no cover
        """The rows (as computed, or as read back from the CSV) as a typed frame."""
        raise NotImplementedError

    @classmethod
    def from_rows(
        cls: type[R],
        rows: Mapping[str, Sequence[Mapping[str, Any]]],
        config: dict[str, Any],
        run_info: dict[str, Any],
    ) -> R:
        """The result of a run's rows, by rows file (what the runner hands to
        :meth:`~.runner.Experiment.result`)."""
        return cls(cls.frame(rows.get(cls.ROWS, [])), config, run_info)

    def write_summary(self, folder: Path) -> None:
        write_csv(Path(folder) / SUMMARY, self.summary)

    def write_files(self, folder: Path) -> None:
        write_csv(Path(folder) / self.ROWS, self.rows)
        self.write_summary(folder)

    @classmethod
    def from_files(
        cls: type[R], folder: Path, config: dict[str, Any], run_info: dict[str, Any]
    ) -> R:
        return cls(cls.frame(read_csv(folder / cls.ROWS)), config, run_info)


def rows_named(doc: str) -> Any:
    """A :class:`RowsResult`'s rows under the name its readers know them by (``per_item``,
    ``per_sequence``), documented with ``doc``."""
    return property(lambda self: self.rows, doc=doc)


def typed_frame(
    rows: Sequence[Mapping[str, Any]],
    key: str,
    ints: Sequence[str] = (),
    floats: Sequence[str] = (),
    *,
    older: Sequence[str] = (),
    blanks: Sequence[str] = (),
) -> pd.DataFrame:
    """Rows (as computed, or as read back from a CSV as strings) as a frame sorted by the
    unit column ``key`` (stable): the columns ``ints`` as int, ``floats`` as float, the int
    columns ``older`` where present (rows from before they were recorded lack them) and
    ``blanks`` as numbers, a blank cell NaN. No rows: an empty frame."""
    frame = pd.DataFrame(list(rows))
    if frame.empty:
        return frame
    for col in [*ints, *(c for c in older if c in frame)]:
        frame[col] = frame[col].astype(int)
    for col in floats:
        frame[col] = frame[col].astype(float)
    for col in blanks:
        frame[col] = pd.to_numeric(frame[col], errors="coerce")
    return frame.sort_values([key], kind="stable").reset_index(drop=True)


def shown(value: float | None, fmt: str = ".2f") -> str:
    """A number for a Markdown table (``tables.md``): ``format(value, fmt)``, a dash where it
    is not defined (NaN: a standard error of one item, a rate with no rows)."""
    if value is None or value != value:
        return "–"
    return format(value, fmt)


def markdown_table(
    head: Sequence[str], rows: Sequence[Sequence[str]], align: str = ""
) -> list[str]:
    """A Markdown table's lines and a blank line after it; ``align`` a letter per column,
    ``l`` or ``r`` (default: the first column left, the others right, for numbers)."""
    align = align or "l" + "r" * (len(head) - 1)
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = [head, rule, *rows]
    return [*("| " + " | ".join(line) + " |" for line in lines), ""]


def write_csv(path: Path, frame: pd.DataFrame) -> None:
    frame.to_csv(path, index=False)


def read_csv(path: Path) -> list[dict[str, str]]:
    """Rows of a CSV as strings (converted exactly by the caller: ``float(str)`` round-trips)."""
    if not path.is_file():
        return []
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))
