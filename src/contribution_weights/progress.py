"""One progress bar for every long step (traces, experiments, reports).

:func:`bar` is ``tqdm`` with the project's defaults: it appears only once a step has run
for ``delay`` seconds (so short work stays quiet and long work always shows progress with a
time estimate), and in notebooks it uses the widget bar only when ipywidgets is installed,
falling back to the text bar instead of tqdm's "IProgress not found" warning.

Where the stream is not a terminal (a log file, a pipe, ``2>&1`` into ``tee``), a bar
redrawn with carriage returns would pile up on one line and glue onto whatever is printed
next; there it writes whole lines instead, each ending in a newline: the first once the
step has run ``delay`` seconds (as on a terminal), then at most one every
:data:`LOG_INTERVAL` seconds, and a last one when it closes (only if a line was shown
before, so quick steps stay quiet). :func:`status` writes whole lines too.

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

    To a stream that is not a terminal (nor a notebook) it writes whole lines, each ending
    in a newline: the first once the step has run ``delay`` seconds, then at most one every
    :data:`LOG_INTERVAL` seconds, and the final state when it closes if a line was shown
    before (kept even with ``leave=False``: a log cannot erase it).
    """
    kwargs.setdefault("dynamic_ncols", True)
    file = kwargs.get("file") or sys.stderr
    if file is not None and not is_terminal(file) and not _in_notebook():
        kwargs["file"] = LineWriter(file)
        kwargs["leave"] = True
        return _log_bar_class()(iterable, delay=delay, **kwargs)
    return _tqdm_class()(iterable, delay=delay, **kwargs)


_LOG_BAR: Any = None


def _log_bar_class() -> Any:
    """tqdm for a log: it redraws as often as on a terminal (so the first line comes once
    ``delay`` has passed), but shows at most one line every :data:`LOG_INTERVAL` seconds,
    save the last when it closes; clearing the bar (``leave=False``) writes nothing."""
    global _LOG_BAR
    if _LOG_BAR is not None:
        return _LOG_BAR
    from tqdm.std import tqdm

    class LogBar(tqdm):
        _shown_at: float | None = None  # when the last line was written
        _closing = False

        def display(self, msg: str | None = None, pos: int | None = None) -> bool:
            if msg == "":  # a clear: a log cannot erase a line
                return True
            now = self._time()
            shown = self._shown_at
            if self._closing and shown is None:  # never shown: a quick step stays quiet
                return True
            if not self._closing and shown is not None and now - shown < LOG_INTERVAL:
                return True
            self._shown_at = now
            return bool(super().display(msg, pos))

        def close(self) -> None:
            self._closing = True
            super().close()

    _LOG_BAR = LogBar
    return LogBar


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
