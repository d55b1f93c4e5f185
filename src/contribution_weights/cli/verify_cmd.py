"""``cw verify``: check a trace folder against the checksums recorded when it was written."""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import add_command

#: the command's line in ``cw --help``, and the text atop its own ``--help``
HELP = "check a trace folder's files against their recorded checksums"
DESCRIPTION = """Recompute the SHA-256 of every file of a trace folder and compare it with the
one recorded in its meta.json when the trace was written. Exit status 0: every file is intact;
1: some are damaged or missing (each is named); 2: the folder holds no trace, or one written
before checksums were recorded."""


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "verify", run, HELP, DESCRIPTION)
    p.add_argument("trace", type=Path, metavar="DIR", help="a trace folder (cw trace --out DIR)")


def run(args: argparse.Namespace) -> int:
    from ..tracing.folder import recorded_checksums, verify

    folder = Path(args.trace)
    damaged = verify(folder)  # no trace, or no checksums: a clear error (exit 2)
    checked = len(recorded_checksums(folder) or {})
    if damaged:
        print(f"{folder}: {len(damaged)} of {checked} files damaged:")
        for damage in damaged:
            print(f"  {damage}")
        print("trace the text again, or copy the folder again from where it was written")
        return 1
    print(f"{folder}: all {checked} files intact")
    return 0
