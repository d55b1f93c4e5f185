"""Tables in the README and docs that are copies of what a run wrote, kept in step with it.

A page marks such a block with two comments around it::

    <!-- generated: docs/results/kv-eval-smollm2-512/tables.md -->
    ...the file's text...
    <!-- end generated -->

and the lines between them are that file's text (a ``.md`` file a run wrote, relative to
the repository); ``<!-- generated: PATH (table) -->`` takes only its Markdown table (the
lines that start with ``|``), leaving out a header such as the machine line of a
benchmark; ``(table N)`` takes only the file's N-th table (1 for the first), for a file
that holds several. A ``.csv`` file (a run's summary) becomes a Markdown table of its rows, numbers
to four significant digits; ``<!-- generated: PATH.csv columns=a,b,c -->`` keeps those
columns, in that order. A ``.json`` object of objects (a trace's ``summary.json``) becomes
a table with one row per key, the same way. :func:`refresh` rewrites each block from
its file (``cw results`` calls it); :func:`stale` names the pages whose blocks differ
from their files, which a test checks, so no number in a marked block is typed by hand or
drifts from its run.
:func:`handwritten_lines` counts a page's lines outside its blocks (the docs' budget of
hand-written text).
"""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path

_BLOCK = re.compile(
    r"(?P<open><!-- generated: (?P<source>[^ ]+)(?P<table> \(table(?: (?P<nth>[1-9][0-9]*))?\))?"
    r"(?: columns=(?P<columns>[^ ]+))? -->\n)(?P<body>.*?)"
    r"(?P<close><!-- end generated -->)",
    re.S,
)


class GeneratedError(ValueError):
    """A marked block names a file that does not exist or holds no table."""


def _cell(value: str) -> str:
    try:
        number = float(value)
    except ValueError:
        return value.replace("|", "\\|")
    if value.strip().lstrip("-").isdigit():
        return value
    return f"{number:.4g}"


def csv_table(source: Path, columns: list[str] | None = None) -> str:
    """A CSV file's rows as a Markdown table (``columns``: those, in that order)."""
    return csv_table_text(source.read_text(), source, columns)


def csv_table_text(text: str, source: Path, columns: list[str] | None = None) -> str:
    """:func:`csv_table` of CSV ``text`` read from ``source`` (named in errors)."""
    rows = list(csv.DictReader(io.StringIO(text)))
    names = columns or (list(rows[0]) if rows else [])
    if not rows or not names:
        raise GeneratedError(f"{source} holds no rows")
    missing = [name for name in names if name not in rows[0]]
    if missing:
        raise GeneratedError(f"{source} has no column {', '.join(missing)}; it has {list(rows[0])}")
    numeric = [all(_is_number(row[name]) for row in rows) for name in names]
    lines = ["| " + " | ".join(names) + " |"]
    lines.append("| " + " | ".join("---:" if n else "---" for n in numeric) + " |")
    lines += ["| " + " | ".join(_cell(row[name]) for name in names) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def json_table(source: Path, columns: list[str] | None = None) -> str:
    """A JSON object of objects (a trace's ``summary.json``: one object per measure) as a
    Markdown table, one row per key, numbers as :func:`csv_table` writes them."""
    data = json.loads(source.read_text())
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise GeneratedError(f"{source} is not a JSON object of objects (one per row)")
    fields = columns or sorted({name for row in data.values() for name in row}, key=str)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["", *fields])
    for key, row in data.items():
        writer.writerow([key, *(row.get(name, "") for name in fields)])
    return csv_table_text(buffer.getvalue(), source, ["", *fields])


def _is_number(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


def text_of(
    source: Path, table: bool = False, columns: list[str] | None = None, nth: int | None = None
) -> str:
    """A run's ``.md`` file as a block holds it: its text (ending in one newline), or with
    ``table`` only its Markdown table, the lines that start with ``|`` (with ``nth``, only
    the lines of its ``nth`` table, 1 for the first)."""
    if not source.is_file():
        raise GeneratedError(f"{source}: no such file (the block's `generated:` names it)")
    if source.suffix == ".csv":
        return csv_table(source, columns)
    if source.suffix == ".json":
        return json_table(source, columns)
    text = source.read_text()
    if not table:
        return text.rstrip("\n") + "\n"
    tables: list[list[str]] = []
    previous = False
    for line in text.splitlines():
        row = line.startswith("|")
        if row and not previous:
            tables.append([])
        if row:
            tables[-1].append(line)
        previous = row
    if not tables:
        raise GeneratedError(f"{source} holds no Markdown table")
    if nth is None:
        return "\n".join(line for rows in tables for line in rows) + "\n"
    if nth > len(tables):
        raise GeneratedError(f"{source} holds {len(tables)} Markdown tables, not {nth}")
    return "\n".join(tables[nth - 1]) + "\n"


def rendered(text: str, repo: Path) -> str:
    """``text`` with every marked block rewritten from its file."""

    def fill(match: re.Match[str]) -> str:
        columns = match["columns"].split(",") if match["columns"] else None
        source = (repo / match["source"]).resolve()
        if not source.is_relative_to(repo.resolve()):
            raise GeneratedError(f"{match['source']} lies outside the repository")
        nth = int(match["nth"]) if match["nth"] else None
        body = text_of(source, match["table"] is not None, columns, nth)
        return match["open"] + body + match["close"]

    return _BLOCK.sub(fill, text)


def pages(repo: Path) -> list[Path]:
    """The pages that may hold blocks: the README and every page under docs/."""
    found = [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]
    return [page for page in found if page.is_file()]


def sources(repo: Path) -> list[str]:
    """Every file a block of the pages names (relative to ``repo``)."""
    return [m["source"] for page in pages(repo) for m in _BLOCK.finditer(page.read_text())]


def stale(repo: Path) -> list[Path]:
    """The pages whose blocks differ from what their files give."""
    return [page for page in pages(repo) if rendered(page.read_text(), repo) != page.read_text()]


def refresh(repo: Path) -> list[Path]:
    """Rewrite every stale page's blocks from their files; the pages rewritten."""
    changed = stale(repo)
    for page in changed:
        page.write_text(rendered(page.read_text(), repo))
    return changed


def handwritten_lines(text: str) -> int:
    """Lines of ``text`` outside its generated blocks (the markers count as written)."""
    return len(_BLOCK.sub(lambda m: m["open"] + m["close"], text).splitlines())
