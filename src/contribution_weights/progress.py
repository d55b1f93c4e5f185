"""One progress bar for every long step (traces, experiments, reports).

:func:`bar` is ``tqdm`` with the project's defaults: it appears only once a step has run
for ``delay`` seconds (so short work stays quiet and long work always shows progress with a
time estimate), and in notebooks it uses the widget bar only when ipywidgets is installed,
falling back to the text bar instead of tqdm's "IProgress not found" warning.

Where the stream is not a terminal (a log file, a pipe, ``2>&1`` into ``tee``), a bar
redrawn with carriage returns would pile up on one line and glue onto whatever is printed
next; there it writes a full line instead, at most every :data:`LOG_INTERVAL` seconds, and
a last one, newline-ended, when it closes. :func:`status` writes whole lines too.

Importing this module (the package does so first) also silences that warning where
others raise it: transformers, huggingface_hub and ``tqdm.auto`` itself warn on import in
a notebook without ipywidgets, then fall back to the same text bar.
"""

from __future__ import annotations

import re
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

DEFAULT_DELAY = 2.0
#: seconds between the lines of a bar written to a file or a pipe (not a terminal)
LOG_INTERVAL = 30.0


def _silence_ipywidgets_warning() -> None:
    """Ignore tqdm's "IProgress not found" warning (its text-bar fallback is what we want)."""
    try:
        from tqdm import TqdmWarning
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return
    warnings.filterwarnings("ignore", message="IProgress not found", category=TqdmWarning)


_silence_ipywidgets_warning()


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:
        shell = None
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def _tqdm_class() -> Any:
    if _in_notebook():
        try:
            import ipywidgets  # noqa: F401
            from tqdm.notebook import tqdm as notebook_tqdm

            return notebook_tqdm
        except ImportError:
            pass
    from tqdm.std import tqdm

    return tqdm


class LineWriter:
    """A stream for tqdm where no terminal is: each redraw becomes one full line.

    tqdm redraws a bar as ``"\\r" + text + padding`` and clears it with ``"\\r"``; here
    every non-blank piece between carriage returns and newlines is written as its own
    line, ending in ``"\\n"`` (a repeat of the line before is dropped). Standard output
    is flushed first, so a log holding both streams keeps them in order.
    """

    def __init__(self, file: Any) -> None:
        self.file = file
        self._last: str | None = None

    def write(self, text: str) -> int:
        for piece in re.split(r"[\r\n]", text):
            line = piece.rstrip()
            if line and line != self._last:
                if self.file is not sys.stdout and sys.stdout is not None:
                    sys.stdout.flush()
                self.file.write(line + "\n")
                self._last = line
        return len(text)

    def flush(self) -> None:
        getattr(self.file, "flush", lambda: None)()

    def __getattr__(self, name: str) -> Any:  # encoding, isatty, fileno: the stream's own
        return getattr(self.file, name)


def is_terminal(file: Any) -> bool:
    """Whether ``file`` is a terminal (where a bar can redraw its line in place)."""
    try:
        return bool(file.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or closed
        return False


def bar(iterable: Any = None, *, delay: float = DEFAULT_DELAY, **kwargs: Any) -> Any:
    """A tqdm bar (``iterable`` and keyword arguments as for ``tqdm``) shown after ``delay`` s.

    To a stream that is not a terminal (nor a notebook) it writes whole lines: the first
    after ``delay`` seconds, then at most one every :data:`LOG_INTERVAL` seconds, and the
    final state when it closes (kept even with ``leave=False``: a log cannot erase it).
    """
    kwargs.setdefault("dynamic_ncols", True)
    cls = _tqdm_class()
    file = kwargs.get("file") or sys.stderr
    if file is not None and not is_terminal(file) and not _in_notebook():
        kwargs["file"] = LineWriter(file)
        kwargs.setdefault("mininterval", LOG_INTERVAL)
        kwargs["maxinterval"] = max(kwargs.get("maxinterval", 0), kwargs["mininterval"])
        kwargs["leave"] = True
    return cls(iterable, delay=delay, **kwargs)


@contextmanager
def status(message: str, *, delay: float = DEFAULT_DELAY, enabled: bool = True) -> Iterator[None]:
    """For a step without a count to show (loading a model, one long computation): print
    ``message`` to stderr once the block has run for ``delay`` seconds, and when it ends
    how long it took; quick steps print nothing."""
    if not enabled:
        yield
        return
    import time

    shown = threading.Event()

    def announce() -> None:
        shown.set()
        _line(f"{message}…")

    timer = threading.Timer(delay, announce)
    timer.daemon = True
    start = time.perf_counter()
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if shown.is_set():
            _line(f"{message}: done in {time.perf_counter() - start:.1f} s")


def _line(text: str) -> None:
    """One whole line on stderr, after what standard output holds; on a terminal through
    ``tqdm.write``, which moves a bar being drawn out of the way instead of gluing to it."""
    if sys.stdout is not None:
        sys.stdout.flush()
    if is_terminal(sys.stderr):
        from tqdm.std import tqdm

        tqdm.write(text, file=sys.stderr)
    else:
        print(text, file=sys.stderr, flush=True)
