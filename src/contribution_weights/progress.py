"""One progress bar for every long step (traces, experiments, reports).

:func:`bar` is ``tqdm`` with the project's defaults: it appears only once a step has run
for ``delay`` seconds (so short work stays quiet and long work always shows progress with a
time estimate), and in notebooks it uses the widget bar only when ipywidgets is installed,
falling back to the text bar instead of tqdm's "IProgress not found" warning.

Importing this module (the package does so first) also silences that warning where
others raise it: transformers, huggingface_hub and ``tqdm.auto`` itself warn on import in
a notebook without ipywidgets, then fall back to the same text bar.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

DEFAULT_DELAY = 2.0


def _silence_ipywidgets_warning() -> None:
    """Ignore tqdm's "IProgress not found" warning (its text-bar fallback is what we want)."""
    try:
        from tqdm import TqdmWarning
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return
    warnings.filterwarnings("ignore", message="IProgress not found", category=TqdmWarning)


_silence_ipywidgets_warning()


def _tqdm_class() -> Any:
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:
        shell = None
    if shell is not None and type(shell).__name__ == "ZMQInteractiveShell":
        try:
            import ipywidgets  # noqa: F401
            from tqdm.notebook import tqdm as notebook_tqdm

            return notebook_tqdm
        except ImportError:
            pass
    from tqdm.std import tqdm

    return tqdm


def bar(iterable: Any = None, *, delay: float = DEFAULT_DELAY, **kwargs: Any) -> Any:
    """A tqdm bar (``iterable`` and keyword arguments as for ``tqdm``) shown after ``delay`` s."""
    kwargs.setdefault("dynamic_ncols", True)
    return _tqdm_class()(iterable, delay=delay, **kwargs)


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
        print(f"{message}…", file=sys.stderr, flush=True)

    timer = threading.Timer(delay, announce)
    timer.daemon = True
    start = time.perf_counter()
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if shown.is_set():
            print(f"{message}: done in {time.perf_counter() - start:.1f} s", file=sys.stderr)
