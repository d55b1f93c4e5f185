"""The ``cw`` command line.

Each sub-command lives in its own module exposing ``register(subparsers)``, which adds
its parser and sets ``func`` (a callable taking the parsed arguments and returning an
exit code). Choices such as measure names are read from the same registries the Python
API uses.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import (
    downstream_cmd,
    faithfulness_cmd,
    geometry_cmd,
    kv_cmd,
    measures_cmd,
    report_cmd,
    trace_cmd,
)

COMMANDS = [
    trace_cmd,
    measures_cmd,
    report_cmd,
    faithfulness_cmd,
    downstream_cmd,
    geometry_cmd,
    kv_cmd,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cw",
        description="Contribution weights: which tokens really drive each attention layer.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from ..capture import CaptureError
    from ..inputs import InputError
    from ..loading import ModelLoadError
    from ..runs import RunFolderError

    expected = (InputError, ModelLoadError, RunFolderError, CaptureError, ValueError)
    try:
        return int(args.func(args) or 0)
    except (*expected, FileNotFoundError) as err:
        print(f"cw {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        message = f"cw {args.command}: interrupted"
        if hasattr(args, "resume"):  # a run folder: say how to continue it
            from ..experiments.runner import resume_hint

            message += "; continue it with:\n  " + resume_hint(
                sys.argv[1:] if argv is None else argv
            )
        print(message, file=sys.stderr)
        return 130
