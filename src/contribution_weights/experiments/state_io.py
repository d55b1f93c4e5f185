"""Accumulator states on disk: tensors and plain containers, read with ``weights_only``.

NumPy arrays become tagged tensors and NumPy scalars Python numbers, so
``torch.load(weights_only=True)`` reads a state back without running pickled code; a
file holding anything else is refused with the fix (:class:`~..runs.RunFolderError`).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..runs import RunFolder, RunFolderError

_NDARRAY = "__ndarray__"


def _plain(obj: Any) -> Any:
    """The state with NumPy arrays as tagged tensors and NumPy scalars as Python numbers:
    only tensors, dicts, lists, tuples, strings and numbers, which
    ``torch.load(weights_only=True)`` reads without running any pickled code."""
    if isinstance(obj, np.ndarray):
        return {_NDARRAY: torch.from_numpy(np.ascontiguousarray(obj))}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_plain(v) for v in obj)
    return obj


def _restored(obj: Any) -> Any:
    """Inverse of :func:`_plain`."""
    if isinstance(obj, dict):
        if set(obj) == {_NDARRAY}:
            return obj[_NDARRAY].numpy()
        return {k: _restored(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_restored(v) for v in obj)
    return obj


def save_state(path: Path, state: dict[str, Any]) -> None:
    """Write an accumulator state atomically (loadable with ``weights_only=True``)."""
    buffer = io.BytesIO()
    torch.save(_plain(state), buffer)
    RunFolder.existing(path.parent, {}).write_bytes(path.name, buffer.getvalue())


def load_state(target: Path) -> dict[str, Any]:
    try:
        state = torch.load(target, weights_only=True)
    except Exception as exc:  # anything but tensors and plain containers is refused
        raise RunFolderError(
            f"cannot resume from {target}: it is not a state this version wrote "
            f"({type(exc).__name__}); delete {target.name} to restart the run from its first "
            "sequence, or choose another --out folder"
        ) from exc
    return _restored(state)
