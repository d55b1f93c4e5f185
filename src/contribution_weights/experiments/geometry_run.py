"""Resumable geometry runs: the accumulators' state persisted after every sequence.

A run folder (:class:`~..runs.RunFolder`) holds ``config.json`` (model, texts
fingerprint, options, analyses) and ``state.pt``, the whole
:class:`~.geometry.GeometryAccumulator` state, replaced atomically (write, then rename)
after each sequence of each phase: phase 1 is the clean observation pass of every
sequence, phase 2 the sink-value scaling passes (which need the sink layers detected in
phase 1). An interrupted run resumed with the same options continues where the state
stops; a finished run resumed just rebuilds the tables. At the end ``tables.json`` and
the per-layer / per-head CSV files are written; figures and Markdown are the
presentation layer's job.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from ..loading import LoadedModel
from ..runs import RunFolder, RunFolderError, fingerprint
from .geometry import GeometryAccumulator, GeometryOptions, encode_texts, resolve_analyses
from .geometry_result import GeometryResult

STATE_FILE = "state.pt"


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


def save_state(folder: RunFolder, acc: GeometryAccumulator) -> None:
    buffer = io.BytesIO()
    torch.save(_plain(acc.state_dict()), buffer)
    folder.write_bytes(STATE_FILE, buffer.getvalue())


def load_state(folder: RunFolder, acc: GeometryAccumulator) -> None:
    target = folder.file(STATE_FILE)
    if not target.exists():
        return
    try:
        state = torch.load(target, weights_only=True)
    except Exception as exc:  # anything but tensors and plain containers is refused
        raise RunFolderError(
            f"cannot resume from {target}: it is not a state this version wrote "
            f"({type(exc).__name__}); delete {STATE_FILE} to restart the run from its first "
            "sequence, or choose another --out folder"
        ) from exc
    acc.load_state_dict(_restored(state))


def run_geometry(
    model: LoadedModel,
    texts: Sequence[str],
    out: str | Path,
    analyses: str | Sequence[str] | None = None,
    options: GeometryOptions | None = None,
    resume: bool = False,
    progress: bool = True,
    source: str = "",
) -> GeometryResult:
    """Run the geometry analyses over ``texts`` into the run folder ``out`` (resumable)."""
    options = options or GeometryOptions()
    names = resolve_analyses(analyses)
    if not texts:
        raise ValueError("no texts to analyse; pass --n 1 or more, or a non-empty file")
    config: dict[str, Any] = {
        "experiment": "geometry",
        "model": model.name,
        "source": source,
        "n_texts": len(texts),
        "texts_sha256": fingerprint(texts),
        "analyses": names,
        **options.to_dict(),
    }
    folder = RunFolder(out, config, resume=resume)
    acc = GeometryAccumulator(model.num_layers, model.num_heads, names, options)
    load_state(folder, acc)
    ids = encode_texts(model, texts, options.max_tokens)
    todo = range(acc.sequences, len(ids))
    for k in tqdm(
        todo, desc="geometry", disable=not progress, total=len(ids), initial=acc.sequences
    ):
        acc.add_sequence(model, ids[k])
        save_state(folder, acc)
    if "sink_scaling" in names and acc.plan_scaling():
        done = len(acc.scaling_nll)
        for k in tqdm(
            range(done, len(ids)),
            desc="sink scaling",
            disable=not progress,
            total=len(ids),
            initial=done,
        ):
            acc.add_scaling(model, ids[k])
            save_state(folder, acc)
    result = acc.result()
    write_tables(
        folder, result, meta={"model": model.name, "tokens": [int(x.numel()) for x in ids]}
    )
    return result


def write_tables(
    folder: RunFolder, result: GeometryResult, meta: dict[str, Any] | None = None
) -> None:
    """``tables.json`` plus CSV files of the per-layer and per-head tables (each atomic)."""
    folder.write_json("tables.json", result.to_json())
    per_layer = [result.sink_rate]
    if result.first_token_weight_by_layer is not None:
        per_layer.append(result.first_token_weight_by_layer.add_prefix("first_token_weight:"))
    if result.entropy_by_layer is not None:
        per_layer.append(result.entropy_by_layer.add_prefix("entropy:"))
    if result.sink_alignment is not None:
        per_layer.append(result.sink_alignment)
    folder.write_bytes("per_layer.csv", pd.concat(per_layer, axis=1).to_csv().encode())
    if result.norm_fit is not None:
        folder.write_bytes("norm_fit.csv", result.norm_fit.to_csv(index=False).encode())
    if meta is not None:
        folder.write_json(
            "meta.json", {"sequences": result.sequences, "points": result.points, **meta}
        )
