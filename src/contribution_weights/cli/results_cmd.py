"""``cw results``: rebuild every results table from the run folders' rows, and the docs'
tables from those files."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .common import add_command

#: the command's line in ``cw --help``, and the text atop its own ``--help``
HELP = "rebuild the results tables and figures from their runs' rows, and the docs' tables"
DESCRIPTION = """Every run folder under DIR/docs/results: its summaries, paired tests,
tables.md and figure are written again from its rows (what the units computed), as the
run wrote them when it ended; then the cross-run tables of every folder holding a
compare.json (geometry's runs side by side) or a contrasts.json (one pair's paired
differences over several runs) are written from those runs' files; then every table of
the README and docs/ marked `<!-- generated: FILE -->` is copied again from its file.
With --check nothing is written: the files and pages that differ are named, and the exit
status is 1 if there are any (0: every table is what its rows give). Geometry's folders
are rebuilt from their tables.json (their accumulator state is not kept); folders of
experiments without a result type are named and passed over. Exit status 2: a folder
could not be read back (each is named; the others are still checked)."""


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "results", run, HELP, DESCRIPTION)
    p.add_argument(
        "repo", type=Path, nargs="?", default=Path("."), metavar="DIR",
        help="the repository (default: the current folder)",
    )  # fmt: skip
    p.add_argument("--check", action="store_true", help="name what differs; write nothing")


def run(args: argparse.Namespace) -> int:
    from .. import generated
    from ..experiments import contrasts
    from ..experiments.geometry import compare
    from ..experiments.rebuild import RebuildError, differences, rebuild, run_folders
    from ..progress import bar

    repo = Path(args.repo)
    root = repo / "docs" / "results"
    if not root.is_dir():
        print(f"cw results: {root} is not a folder; run it in the repository", file=sys.stderr)
        return 2
    step = differences if args.check else rebuild
    draw = _draw
    stale = 0
    failed = []
    passed_over: dict[str, int] = {}  # why -> how many folders
    for folder in bar(run_folders(root), desc="run folders", unit="folder"):
        try:
            found = step(folder, draw)
        except RebuildError as err:  # named, and the other folders still checked
            failed.append(str(err))
            continue
        if found.skipped is not None:
            passed_over[found.skipped] = passed_over.get(found.skipped, 0) + 1
        elif found.differing:
            stale += 1
            verb = "differs" if args.check else "rebuilt"
            print(f"{verb}: {folder.relative_to(repo)}: {', '.join(found.differing)}")
    cross_run = [(compare, f) for f in compare.comparison_folders(root)]
    cross_run += [(contrasts, f) for f in contrasts.contrast_folders(root)]
    for table_set, folder in cross_run:  # from the run folders just rebuilt
        try:
            changed = table_set.differences(folder) if args.check else table_set.rebuild(folder)
        except (OSError, KeyError, ValueError) as err:
            failed.append(f"{folder}: its comparison could not be built ({err})")
            continue
        if changed:
            stale += 1
            verb = "differs" if args.check else "rebuilt"
            print(f"{verb}: {folder.relative_to(repo)}: {', '.join(changed)}")
    try:
        pages = generated.stale(repo) if args.check else generated.refresh(repo)
    except generated.GeneratedError as err:
        print(f"cw results: {err}", file=sys.stderr)
        return 2
    for page in pages:
        print(f"{'differs' if args.check else 'rewritten'}: {page.relative_to(repo)}")
    for why, count in passed_over.items():
        print(f"passed over {count} folder{'s' * (count != 1)}: {why}")
    for error in failed:
        print(f"cw results: {error}", file=sys.stderr)
    if failed:
        return 2
    if not stale and not pages and not passed_over:
        print("every table is what its rows give")
    return 1 if args.check and (stale or pages) else 0


def _draw(name: str, result: Any, into: Path) -> None:
    """The run's figures (and geometry's tables.md), as its command draws them."""
    from ..experiments.spec import EXPERIMENTS
    from ..presentation.figures import plot

    if name == "geometry":  # as cw geometry titles and writes them
        from ..presentation.geometry_plots import write_figures, write_markdown

        config = result.config
        title = (
            f"{config.get('model')} on {config.get('source')} ({result.sequences} texts, "
            f"≤{config.get('max_tokens')} tokens)"
        )
        write_markdown(result, into / "tables.md", title)
        write_figures(result, into, title=str(config.get("model")))
        return
    figure = EXPERIMENTS.get(name).figure_name(result)
    if figure is not None:
        plot(result, into / figure)
