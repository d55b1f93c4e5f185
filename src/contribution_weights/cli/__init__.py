"""The ``cw`` command line.

Each sub-command lives in its own module exposing ``register(subparsers)``, which adds
its parser and sets ``func`` (a callable taking the parsed arguments and returning an
exit code). Choices such as measure names are read from the same registries the Python
API uses.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

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


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (a closing session, ``kill``, a scheduler's time limit) ends a command the
    way Ctrl-C does: run folders record what finished (``run_info.json`` with
    ``finished: false`` and the seconds spent) and the resume hint is printed."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from ..capture import CaptureError
    from ..inputs import InputError
    from ..loading import ModelLoadError
    from ..runs import RunFolderError

    expected = (InputError, ModelLoadError, RunFolderError, CaptureError, ValueError)
    try:
        with _terminate_as_interrupt():
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
