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

import warnings
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
        from IPython import get_ipython  # type: ignore[attr-defined]

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
