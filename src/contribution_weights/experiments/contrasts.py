"""Paired contrasts across runs: the docs' tables that set one pair of methods (or
measures) side by side over several run folders, built from the folders' paired files.

Each run folder's paired file (``summary_pairs.csv`` of kv-eval, ``summary_paired.csv``
of faithfulness and attribution-eval) holds, for every pair, the paired mean difference,
its standard error, its 95% interval and its verdict under the run's own Holm family. A
table here picks one cell of those files per (row, column): the folder and the filters
come from the table, the row and the column together. Nothing is recomputed and no number
is typed by hand; :func:`rebuild` rewrites the tables (``cw results`` does) and
:func:`differences` names the stale ones (``cw results --check``).

A folder holding a ``contrasts.json`` gets one ``NAME.md`` per table::

    {"tables": [{"name": "kv-contribution-vs-window",
                 "file": "summary_pairs.csv",
                 "folder": "kv-{model}-{data}-{context}",
                 "where": {"reference": "contribution", "other": "window_attention"},
                 "cell": "se", "digits": 3,
                 "corner": "model, data, C",
                 "rows": [{"label": "SmolLM2 FineWeb-Edu 512",
                           "vars": {"model": "smollm2", "data": "fineweb-edu", "context": 512}}],
                 "columns": [{"label": "ratio 0.25", "where": {"ratio": 0.25}}]}]}

``folder`` is a template filled from the table's, the row's and the column's ``vars``
(a folder next to ``contrasts.json``'s folder, under docs/results); ``where`` filters the
paired file's rows (numbers compare as numbers). A pair is found in either order; stored
the other way round, its difference, interval and verdict are turned round. Cells:

- ``se``: ``+0.005 ± 0.002``; ``interval``: ``+0.005 [+0.001, +0.009]``; both bold when
  the verdict is decided (not a tie).
- ``signs``: one sign per method of ``others`` (a list of groups, which `` · `` separates):
  ``+`` the reference better, ``−`` the other better, ``=`` a tie.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from .paired import OTHER_BETTER, REFERENCE_BETTER, TIE

SPEC = "contrasts.json"
_SIGN = {REFERENCE_BETTER: "+", OTHER_BETTER: "−", TIE: "="}
_TURNED = {REFERENCE_BETTER: OTHER_BETTER, OTHER_BETTER: REFERENCE_BETTER, TIE: TIE}


class ContrastError(ValueError):
    """A table of ``contrasts.json`` names a folder, file or pair its runs do not hold."""


def _same(value: str, wanted: Any) -> bool:
    if isinstance(wanted, (int, float)) and not isinstance(wanted, bool):
        try:
            return float(value) == float(wanted)
        except ValueError:
            return False
    return value == str(wanted)


class _Rows:
    """The paired files read so far, by path (a table reads each folder's file once)."""

    def __init__(self) -> None:
        self._files: dict[Path, list[dict[str, str]]] = {}

    def pair(self, path: Path, where: dict[str, Any]) -> dict[str, Any]:
        """The row of ``path`` matching ``where``, its pair in the order ``where`` names."""
        if path not in self._files:
            if not path.is_file():
                raise ContrastError(f"{path} does not exist")
            with path.open(newline="") as handle:
                self._files[path] = list(csv.DictReader(handle))
        rows = self._files[path]
        turned = dict(where, reference=where.get("other"), other=where.get("reference"))
        for wanted, swap in ((where, False), (turned, True)):
            found = [r for r in rows if all(_same(r.get(k, ""), v) for k, v in wanted.items())]
            if len(found) > 1:
                raise ContrastError(f"{path}: {len(found)} rows match {where}; name more columns")
            if found:
                return _oriented(found[0], swap)
        raise ContrastError(f"{path} has no row matching {where}")


def _oriented(row: dict[str, str], swap: bool) -> dict[str, Any]:
    mean, low, high = float(row["mean"]), float(row["ci_low"]), float(row["ci_high"])
    if swap:
        mean, low, high = -mean, -high, -low
    verdict = _TURNED[row["verdict"]] if swap else row["verdict"]
    return {"mean": mean, "se": float(row["se"]), "low": low, "high": high, "verdict": verdict}


def _cell(kind: str, found: dict[str, Any], digits: int) -> str:
    mean = f"{found['mean']:+.{digits}f}"
    if kind == "se":
        text = f"{mean} ± {found['se']:.{digits}f}"
    elif kind == "interval":
        text = f"{mean} [{found['low']:+.{digits}f}, {found['high']:+.{digits}f}]"
    else:
        raise ContrastError(f"unknown cell {kind!r}: use se, interval or signs")
    return f"**{text}**" if found["verdict"] != TIE else text


def table(spec: dict[str, Any], root: Path) -> str:
    """One table of ``contrasts.json`` as Markdown, its cells read from the runs under ``root``."""
    rows, kind, digits = _Rows(), spec.get("cell", "se"), int(spec.get("digits", 3))
    columns = spec["columns"]
    lines = [
        "| " + " | ".join([spec.get("corner", "")] + [c["label"] for c in columns]) + " |",
        "| --- | " + " | ".join("---" if kind == "signs" else "---:" for _ in columns) + " |",
    ]
    for row in spec["rows"]:
        cells = [row["label"]]
        for column in columns:
            names = {**spec.get("vars", {}), **row.get("vars", {}), **column.get("vars", {})}
            try:
                folder = spec["folder"].format(**names)
            except KeyError as err:
                raise ContrastError(f"table {spec['name']}: no value for {err} in {names}") from err
            path = root / folder / spec["file"]
            where = {**spec.get("where", {}), **row.get("where", {}), **column.get("where", {})}
            if kind == "signs":
                groups = [
                    " ".join(_SIGN[rows.pair(path, {**where, "other": o})["verdict"]] for o in g)
                    for g in spec["others"]
                ]
                cells.append(" · ".join(groups))
            else:
                cells.append(_cell(kind, rows.pair(path, where), digits))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render(folder: str | Path) -> dict[str, str]:
    """Every table of the ``contrasts.json`` in ``folder``, by file name."""
    folder = Path(folder)
    spec = json.loads((folder / SPEC).read_text())
    return {f"{t['name']}.md": table(t, folder.parent) for t in spec["tables"]}


def contrast_folders(root: str | Path) -> list[Path]:
    """The folders under ``root`` that hold a ``contrasts.json``."""
    return sorted(path.parent for path in Path(root).rglob(SPEC))


def stale_files(folder: Path, texts: dict[str, str]) -> list[str]:
    """The names of ``texts`` whose file in ``folder`` is missing or holds other text."""
    return [
        n
        for n, text in texts.items()
        if not (folder / n).is_file() or (folder / n).read_text() != text
    ]


def differences(folder: str | Path) -> list[str]:
    """The table files in ``folder`` that differ from what their runs give."""
    return stale_files(Path(folder), render(folder))


def write_stale(folder: Path, texts: dict[str, str]) -> list[str]:
    """Write the files of ``texts`` that :func:`stale_files` names; their names."""
    changed = stale_files(folder, texts)
    for name in changed:
        (folder / name).write_text(texts[name])
    return changed


def rebuild(folder: str | Path) -> list[str]:
    """Rewrite the table files in ``folder`` that differ from what their runs give; which."""
    return write_stale(Path(folder), render(folder))
