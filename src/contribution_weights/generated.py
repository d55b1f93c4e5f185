"""Tables in the README and docs that are copies of what a run wrote, kept in step with it.

A page marks such a table with two comments around it::

    <!-- generated: docs/results/bench-trace/bench_trace-smollm2-t1.md -->
    | T | method | ... |
    <!-- end generated -->

and the lines between them are the Markdown table of that file (its lines that start with
``|``; a ``.md`` file a run wrote, relative to the repository). :func:`refresh` rewrites
each block from its file; :func:`stale` names the blocks that differ from theirs, which a
test checks, so no number in a marked table is typed by hand or drifts from its run.
"""

from __future__ import annotations

import re
from pathlib import Path

_BLOCK = re.compile(
    r"(?P<open><!-- generated: (?P<source>[^ ]+) -->\n)(?P<body>.*?)"
    r"(?P<close><!-- end generated -->)",
    re.S,
)


class GeneratedError(ValueError):
    """A marked block names a file that does not exist or holds no table."""


def table_of(source: Path) -> str:
    """The Markdown table of a run's ``.md`` file: its lines that start with ``|``."""
    if not source.is_file():
        raise GeneratedError(f"{source}: no such file (the block's `generated:` names it)")
    rows = [line for line in source.read_text().splitlines() if line.startswith("|")]
    if not rows:
        raise GeneratedError(f"{source} holds no Markdown table")
    return "\n".join(rows) + "\n"


def rendered(text: str, repo: Path) -> str:
    """``text`` with every marked block rewritten from its file."""

    def fill(match: re.Match[str]) -> str:
        table = table_of(repo / match["source"])
        return match["open"] + table + match["close"]

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
