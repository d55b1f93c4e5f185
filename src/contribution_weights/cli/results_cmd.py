"""``cw results``: rebuild every results table from the run folders' rows, and the docs'
tables from those files."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .common import add_command

#: the command's line in ``cw --help``, and the text atop its own ``--help``
HELP = "rebuild the results tables from their runs' rows, and the docs' tables from them"
DESCRIPTION = """Every run folder under DIR/docs/results: its summaries, paired tests and
tables.md are written again from its rows (what the units computed), as the run wrote them
when it ended; then every table of the README and docs/ marked `<!-- generated: FILE -->`
is copied again from its file. With --check nothing is written: the files and pages that
differ are named, and the exit status is 1 if there are any (0: every table is what its
rows give). Folders of experiments whose rows are not kept (geometry's accumulator state)
are named and passed over."""


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "results", run, HELP, DESCRIPTION)
    p.add_argument(
        "repo", type=Path, nargs="?", default=Path("."), metavar="DIR",
        help="the repository (default: the current folder)",
    )  # fmt: skip
    p.add_argument("--check", action="store_true", help="name what differs; write nothing")


def run(args: argparse.Namespace) -> int:
    from .. import generated
    from ..experiments.rebuild import differences, rebuild, run_folders
    from ..progress import bar

    repo = Path(args.repo)
    root = repo / "docs" / "results"
    if not root.is_dir():
        print(f"cw results: {root} is not a folder; run it in the repository", file=sys.stderr)
        return 2
    step = differences if args.check else rebuild
    stale = 0
    passed_over: dict[str, int] = {}  # why -> how many folders
    for folder in bar(run_folders(root), desc="run folders", unit="folder"):
        found = step(folder)
        if found.skipped is not None:
            passed_over[found.skipped] = passed_over.get(found.skipped, 0) + 1
        elif found.differing:
            stale += 1
            verb = "differs" if args.check else "rebuilt"
            print(f"{verb}: {folder.relative_to(repo)}: {', '.join(found.differing)}")
    try:
        pages = generated.stale(repo) if args.check else generated.refresh(repo)
    except generated.GeneratedError as err:
        print(f"cw results: {err}", file=sys.stderr)
        return 2
    for page in pages:
        print(f"{'differs' if args.check else 'rewritten'}: {page.relative_to(repo)}")
    for why, count in passed_over.items():
        print(f"passed over {count} folder{'s' * (count != 1)}: {why}")
    if not stale and not pages:
        print("every table is what its rows give")
    return 1 if args.check and (stale or pages) else 0
