"""The trace folder format: what a trace writes, and reading it back.

A trace is a folder (format 2; folders of the first format, a single
``trace.safetensors``, still load):

* ``maps/layer-NNN.safetensors``: the stored maps of one model layer, packed lower
  triangles (:mod:`.storage`), absent for a trace without maps;
* ``vectors.safetensors``: ``input_ids`` and the per-layer vectors;
* ``reductions.safetensors``: the reductions, when they were computed in the forward;
* ``tokens.json`` (``{"ids": [...], "tokens": [...]}``), ``meta.json`` (model, layers,
  measures, stored maps, storage dtype, and the SHA-256 of every other data file,
  ``checksums``) and ``summary.json`` (first-token weight and entropy per weight measure;
  strict JSON, ``null`` where a value is undefined).

A trace is written into a staging folder and moved into place when complete, by one
writer at a time (:mod:`.folder`).

This module never sees a :class:`~.result.Trace`: it writes the pieces it is given and
reads a folder back into the pieces a trace is built from (:func:`read_folder`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..measures.reductions import MeasureReductions
from ..measures.registry import MEASURES
from .storage import LegacyMaps, MapStore, PackedMaps, TraceFileError, save_tensors, storage_dtype

FORMAT = 2
# files a trace folder may hold; a new trace into a folder removes the ones it does not write
TRACE_FILES = (
    "trace.safetensors",
    "vectors.safetensors",
    "reductions.safetensors",
    "tokens.json",
    "meta.json",
    "summary.json",
    "heatmaps.png",
    "first_token_weight.png",
)
#: the entries of a trace folder: a new trace replaces all of them (figures included)
TRACE_ENTRIES = ("maps", *TRACE_FILES)
CHECKED_FILES = ("vectors.safetensors", "reductions.safetensors", "tokens.json", "summary.json")
VECTOR_NAMES = (
    "bias_share",
    "degenerate",
    "degenerate_heads",
    "zero_values",
    "value_norm",
    "output_norm",
    "key_start",
    "key_stop",
)


# ---- folders ------------------------------------------------------------------------------
def trace_files(folder: str | Path) -> list[str]:
    """The trace files ``folder`` holds (``"maps/"`` for the shards), read from the disk:
    after a trace (which replaces every earlier trace file), exactly the files it wrote."""
    folder = Path(folder)
    found = ["maps/"] if (folder / "maps").is_dir() else []
    return found + [name for name in TRACE_FILES if (folder / name).is_file()]


def _strict(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strict(v) for v in value]
    return value


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_strict(obj), indent=2, allow_nan=False))
    tmp.replace(path)


def write_metadata(
    out: Path,
    *,
    input_ids: Tensor,
    tokens: list[str],
    vectors: dict[str, Tensor],
    reductions: dict[str, MeasureReductions],
    meta: dict[str, Any],
    summary: dict[str, Any],
    checksums: dict[str, str] | None = None,
) -> None:
    """Write everything but the maps: vectors, reductions, tokens, summary, and meta last
    with the checksums of those files and of the maps' shards (``checksums``)."""
    from .folder import digests

    saved = {k: _savable(v) for k, v in vectors.items()}
    saved["input_ids"] = input_ids.to(torch.int64).contiguous()
    save_tensors(saved, out / "vectors.safetensors")  # 0o666 & ~umask, not save_file's 0600
    if reductions:
        tensors: dict[str, Tensor] = {}
        seen: set[int] = set()
        for r in reductions.values():
            for k, v in r.tensors().items():
                v = v.contiguous()
                # shared tensors (vw_on's top keys are vw's) are written as copies
                tensors[k] = v.clone() if v.data_ptr() in seen else v
                seen.add(v.data_ptr())
        save_tensors(tensors, out / "reductions.safetensors")
    else:
        (out / "reductions.safetensors").unlink(missing_ok=True)
    write_json(out / "tokens.json", {"ids": input_ids.tolist(), "tokens": tokens})
    write_json(out / "summary.json", summary)
    sums = {**(checksums or {}), **digests(out, list(CHECKED_FILES))}
    meta = {**meta, "format": FORMAT, "checksums": dict(sorted(sums.items()))}
    write_json(out / "meta.json", meta)


def _savable(x: Tensor) -> Tensor:
    return (x.to(torch.uint8) if x.dtype == torch.bool else x).contiguous().cpu()


def _read_json(path: Path, what: str) -> Any:
    if not path.is_file():
        raise TraceFileError(f"{path} is missing; a trace folder holds {what}")
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceFileError(f"{path} is not valid JSON ({exc}); trace the text again") from None


def _read_tensors(path: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    if not path.is_file():
        raise TraceFileError(f"{path} is missing: the trace folder is incomplete")
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types
        raise TraceFileError(
            f"{path} is not a readable safetensors file ({exc}); it may be truncated by an "
            "interrupted write: trace the text again"
        ) from None


def _check_registered(folder: Path, measures: list[str]) -> None:
    """Every measure of the trace must be registered here to be read (summaries, derived
    maps and figures look it up): one registered in the process that traced it with
    ``cw.register_measure`` must be registered again before the folder loads."""
    missing = [name for name in measures if name not in MEASURES]
    if missing:
        names = ", ".join(repr(name) for name in missing)
        one = len(missing) == 1
        raise TraceFileError(
            f"the trace in {folder} holds the measure{'' if one else 's'} {names}, "
            f"{'which is' if one else 'which are'} not registered in this process "
            f"(registered: {', '.join(MEASURES.names())}); register "
            f"{'it' if one else 'them'} as the process that traced it did, with "
            "cw.register_measure(cw.Measure(...)), before loading the trace"
        )


def read_folder(folder: Path, verify: bool = False) -> dict[str, Any]:
    """The pieces of the trace in ``folder`` (the arguments of ``Trace``), maps opened lazily.

    ``verify``: first recompute every file's checksum and raise naming the damaged ones.
    """
    from .folder import _no_trace_hint
    from .folder import verify as verify_folder

    if not folder.is_dir():
        raise TraceFileError(f"{folder} is not a folder; pass the folder a trace was written to")
    legacy = folder / "trace.safetensors"
    if not (folder / "meta.json").exists() and not legacy.exists():
        raise TraceFileError(f"{folder} holds no trace (no meta.json); {_no_trace_hint(folder)}")
    if verify:
        damaged = verify_folder(folder)
        if damaged:
            raise TraceFileError(
                f"the trace in {folder} is damaged: "
                + "; ".join(str(d) for d in damaged)
                + ". Trace the text again, or copy the folder again from where it was written"
            )
    meta = _read_json(folder / "meta.json", "meta.json, tokens.json and the tensors")
    tokens = _read_json(folder / "tokens.json", "tokens.json with the ids and tokens")
    if not isinstance(tokens, dict) or not isinstance(tokens.get("tokens"), list):
        raise TraceFileError(f"{folder / 'tokens.json'} has no 'tokens' list")
    if not isinstance(meta, dict) or "layers" not in meta or "measures" not in meta:
        raise TraceFileError(f"{folder / 'meta.json'} lacks 'layers' or 'measures'")
    _check_registered(folder, list(meta["measures"]))
    if meta.get("format", 1) >= 2:
        vectors = _read_tensors(folder / "vectors.safetensors")
        maps: MapStore | None = None
        heads = int(meta["num_heads"])
        t = int(vectors["input_ids"].numel())
        if meta.get("maps", True):
            maps = PackedMaps(
                folder / "maps",
                list(meta["stored"]),
                list(meta["layers"]),
                heads,
                t,
                storage_dtype(meta.get("storage_dtype", "float32")),
                checksums=dict(meta.get("checksums") or {}),
            )
            for pos in range(len(meta["layers"])):
                if not maps.path(pos).is_file():
                    raise TraceFileError(
                        f"{maps.path(pos)} is missing: the trace folder is incomplete "
                        "(an interrupted trace?); trace the text again"
                    )
        reductions: dict[str, MeasureReductions] = {}
        if (folder / "reductions.safetensors").exists():
            red = _read_tensors(folder / "reductions.safetensors")
            for name in meta["measures"]:
                if f"{name}.token_sums" in red:
                    reductions[name] = MeasureReductions.from_tensors(name, red)
    else:
        raw = _read_tensors(legacy)
        missing = [m for m in meta["measures"] if m not in raw]
        if missing:
            raise TraceFileError(f"{legacy} lacks the measures {missing} that meta.json lists")
        vectors = {k: v for k, v in raw.items() if k not in meta["measures"]}
        heads = int(raw[meta["measures"][0]].shape[1])
        t = int(vectors["input_ids"].numel())
        maps = LegacyMaps(legacy, list(meta["measures"]))
        reductions = {}
    ids = vectors.pop("input_ids")
    for flag in ("degenerate", "degenerate_heads", "zero_values"):
        if flag in vectors:
            vectors[flag] = vectors[flag].bool()
    if len(tokens["tokens"]) != t or tokens.get("ids", ids.tolist()) != ids.tolist():
        raise TraceFileError(
            f"{folder / 'tokens.json'} does not match the tensors: it has "
            f"{len(tokens['tokens'])} tokens, the trace {t}; the folder mixes two traces: "
            "trace the text again into an empty folder"
        )
    for name, v in vectors.items():
        if v.shape[0] != len(meta["layers"]) or v.shape[-1] != t:
            raise TraceFileError(
                f"{name} in {folder} has shape {tuple(v.shape)}, not ({len(meta['layers'])}, …, "
                f"{t}): the folder mixes two traces; trace the text again into an empty folder"
            )
    known = ("model", "layers", "measures", "num_heads", "stored", "maps", "format", "checksums")
    return dict(
        input_ids=ids,
        tokens=list(tokens["tokens"]),
        layers=list(meta["layers"]),
        measures=list(meta["measures"]),
        num_heads=heads,
        vectors=vectors,
        maps=maps,
        reductions=reductions,
        model_name=meta.get("model", ""),
        meta={k: v for k, v in meta.items() if k not in known},
        path=folder,
    )
