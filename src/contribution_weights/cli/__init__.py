"""The ``cw`` command line.

Each hand-written sub-command lives in its own module exposing ``register(subparsers)``,
which adds its parser and sets ``func`` (a callable taking the parsed arguments and
returning an exit code); every experiment registered with
:func:`~..experiments.spec.register_experiment` gets a command generated from its spec
(:mod:`.experiment_cmd`). Choices such as measure names are read from the same registries
the Python API uses. The parser is built from light modules only, so ``--help`` and
argument errors answer before torch is imported.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from ..experiments.spec import EXPERIMENTS
from ..registry import import_if_present
from . import (
    attribute_cmd,
    experiment_cmd,
    geometry_cmd,
    measures_cmd,
    report_cmd,
    results_cmd,
    show_cmd,
    trace_cmd,
    verify_cmd,
)

#: commands written by hand; every registered experiment gets one generated from its spec
COMMANDS = [
    trace_cmd, show_cmd, attribute_cmd, measures_cmd, report_cmd, verify_cmd, geometry_cmd,
    results_cmd,
]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cw",
        description="Contribution weights: which tokens really drive each attention layer.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for command in COMMANDS:
        command.register(sub)
    taken = set(sub.choices)
    for spec in EXPERIMENTS:
        if spec.name not in taken:
            experiment_cmd.register(sub, spec)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C's KeyboardInterrupt would be (the same clean-up)."""


def _interrupt(signum: int, frame: Any) -> None:
    raise Terminated


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (a closing session, ``kill``, a scheduler's time limit) ends a command the
    way Ctrl-C does: run folders record what finished (``run_info.json`` with
    ``finished: false`` and the seconds spent) and the resume hint is printed; the exit
    status is 143 (128 + SIGTERM) where Ctrl-C's is 130."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


#: exit status when standard output closes early (``cw measures | head``): 128 + SIGPIPE,
#: what the shell reports for a C program the closed pipe stops, so a ``set -o pipefail``
#: script sees the same as for ``yes | head``, and an interactive shell prints nothing
CLOSED_PIPE = 128 + 13


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``cw`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    A reader that stops early (``cw measures | head``) ends the command quietly: what is
    left to print is discarded and the status is :data:`CLOSED_PIPE`, with no traceback.
    """
    try:
        try:
            return _main(argv)
        finally:
            # output still buffered for a pipe is written here, where a closed pipe is
            # caught, not at interpreter exit (which would print "Exception ignored")
            if sys.stdout is not None:
                sys.stdout.flush()
    except BrokenPipeError:
        _discard_stdout()
        return CLOSED_PIPE


def _discard_stdout() -> None:
    """Point standard output at the null device, so that flushing it at exit (Python
    does) raises nothing more: the standard recipe for a closed pipe."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):  # no real file behind stdout (tests)
        pass


def _expected(err: Exception) -> bool:
    """Whether ``err`` is a mistake its message fully explains (exit status 2, no
    traceback). The error classes are imported here, once a command has failed, so that
    a command that fails early (a missing --file) never waits for torch."""
    if isinstance(err, ValueError | FileNotFoundError):  # InputError is a ValueError
        return True
    from ..capture import CaptureError
    from ..loading import ModelLoadError
    from ..runs import RunFolderError

    return isinstance(err, ModelLoadError | RunFolderError | CaptureError)


def _as_flags(message: str, parser: argparse.ArgumentParser, command: str) -> str:
    """An options error as the command line spells it: a message that begins with an
    option's field name (``max_tokens must be at least 1``, ``kernels='triton' needs``)
    begins with its flag instead (``--max-tokens must be at least 1``)."""
    first = message.split(" ", 1)[0].split("=", 1)[0]
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    command_parser = sub.choices.get(command) if sub is not None else None
    if command_parser is None or not first.isidentifier():
        return message
    for action in command_parser._actions:
        flags = [f for f in action.option_strings if f.startswith("--")]
        if action.dest == first and flags:
            return flags[0] + message[len(first) :]
    return message


#: comma-separated modules ``cw`` imports before it builds its parser: where measures, KV
#: methods and experiments registered outside the package reach the command line
PLUGINS_ENV = "CW_PLUGINS"


class PluginNotFoundError(ValueError):
    """A module named in ``CW_PLUGINS`` cannot be found (or is not a module name)."""


def load_plugins(names: str | None = None) -> list[str]:
    """Import the modules named in ``names`` (default: the ``CW_PLUGINS`` environment
    variable), comma-separated, so that what they register (``cw.register_measure``,
    ``cw.kv.register_method``, ``register_experiment``) is known to every command, under
    ``accelerate launch`` too. Returns the names imported. A module that cannot be found
    is a :class:`PluginNotFoundError` naming it and the fix; an error inside a module
    propagates with its traceback."""
    value = os.environ.get(PLUGINS_ENV, "") if names is None else names
    loaded = []
    for name in (n.strip() for n in value.split(",")):
        if not name:
            continue
        if name.endswith(".py") or "/" in name or "\\" in name or name.startswith("."):
            stem = name.replace("\\", "/").rsplit("/", 1)[-1].removesuffix(".py")
            raise PluginNotFoundError(
                f"{PLUGINS_ENV}: {name!r} is a file or path, not a module name; name the "
                f"module and put its folder on PYTHONPATH (PYTHONPATH=FOLDER "
                f"{PLUGINS_ENV}={stem or 'module'} cw ...)"
            )
        if import_if_present(name) is None:
            raise PluginNotFoundError(
                f"{PLUGINS_ENV}: cannot import module {name!r}; name an importable "
                f"module: installed, or on PYTHONPATH (for a file ./{name}.py in the "
                f"current folder: PYTHONPATH=. {PLUGINS_ENV}={name} cw ...)"
            )
        loaded.append(name)
    return loaded


def _main(argv: Sequence[str] | None) -> int:
    try:
        load_plugins()
    except PluginNotFoundError as err:
        print(f"cw: error: {err}", file=sys.stderr)
        return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with _terminate_as_interrupt():
            return int(args.func(args) or 0)
    except Exception as err:
        if not _expected(err):
            raise
        print(f"cw {args.command}: error: {_as_flags(str(err), parser, args.command)}",
              file=sys.stderr)  # fmt: skip
        return 2
    except KeyboardInterrupt as stop:
        terminated = isinstance(stop, Terminated)
        message = f"cw {args.command}: {'terminated' if terminated else 'interrupted'}"
        if hasattr(args, "resume"):  # a run folder: say how to continue it
            from ..experiments.runner import resume_hint

            message += "; continue it with:\n  " + resume_hint(
                sys.argv[1:] if argv is None else argv
            )
        print(message, file=sys.stderr)
        # the shell's statuses for the two signals: 128 + SIGTERM (15), 128 + SIGINT (2)
        return 128 + 15 if terminated else 128 + 2
