"""The memory preflight: before anything is allocated, estimate what a trace needs and
refuse, with the options that would fit, when it would not (:class:`MemoryPreflightError`)."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..capture import rows_per_block
from ..inputs import InputError
from ..loading import LoadedModel
from ..measures.registry import get_measure, stored_measures


class MemoryPreflightError(InputError):
    """A trace would not fit in memory or on disk; the message lists options that fit."""


# ---- memory preflight ---------------------------------------------------------------------
@dataclass
class MemoryPlan:
    """What a trace will hold, in bytes (estimates; see :func:`plan_memory`)."""

    maps_memory: int
    maps_disk: int
    reductions: int
    working: int

    @property
    def memory(self) -> int:
        return self.maps_memory + self.reductions + self.working


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.0f} MB"


def plan_memory(
    model: LoadedModel,
    num_tokens: int,
    measures: list[str],
    num_layers: int,
    *,
    maps: bool,
    streamed: bool,
    storage: torch.dtype,
    compute: torch.dtype,
    top_k: int,
    block_bytes: int,
    reductions: bool,
) -> MemoryPlan:
    """Estimate the bytes a trace needs: maps (in memory or on disk), reductions, and the
    working set of the forward (one block of queries and the model's activations)."""
    cfg = model.text_config
    heads = int(getattr(cfg, "num_attention_heads", 1))
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    hidden = int(getattr(cfg, "hidden_size", 0) or 0)
    head_dim = int(getattr(cfg, "head_dim", None) or (hidden // max(1, heads)))
    ffn = int(getattr(cfg, "intermediate_size", None) or 4 * hidden)
    t = num_tokens
    stored = stored_measures(measures, storage) if maps else []
    size = torch.empty((), dtype=storage).element_size()
    csize = torch.empty((), dtype=compute).element_size()
    per_map = num_layers * heads * t * t * size
    packed = num_layers * heads * (t * (t + 1) // 2) * size
    maps_memory = 0 if (streamed or not maps) else per_map * len(stored)
    maps_disk = packed * len(stored) if (streamed and maps) else 0
    red = 0
    if reductions:
        key = 2 if t <= 2**15 else 4
        weights = sum(get_measure(m).is_weight for m in measures)
        per = weights * (5 * csize + top_k * (csize + key)) + (len(measures) - weights) * 3 * csize
        red = num_layers * heads * t * per
    rows = min(t, rows_per_block(heads, t, block_bytes))
    block = rows * heads * t * csize
    temps = 6 + len(stored) + (len(measures) if reductions else 0)
    activations = t * (hidden * 8 + ffn * 4 + (heads + 2 * kv) * head_dim * 3) * 4
    vectors = num_layers * heads * t * 16
    # the mask transformers builds for the forward: none for plain causal layers, a T × T
    # bool mask for sliding-window ones
    masks = t * t if getattr(cfg, "sliding_window", None) is not None else 0
    working = block * temps + activations + vectors + masks
    return MemoryPlan(maps_memory, maps_disk, red, working)


def available_memory(device: torch.device | str) -> int:
    """Bytes free now: the accelerator's free memory, or the host's available memory."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _preflight(
    model: LoadedModel,
    num_tokens: int,
    names: list[str],
    layers: list[int],
    out: Path | None,
    maps: bool,
    storage: torch.dtype,
    compute: torch.dtype,
    top_k: int,
    block_bytes: int,
    limit: int | None,
) -> None:
    def plan(**change: Any) -> MemoryPlan:
        args: dict[str, Any] = dict(
            maps=maps,
            streamed=out is not None,
            storage=storage,
            compute=compute,
            top_k=top_k,
            block_bytes=block_bytes,
            reductions=not maps or out is not None,
        )
        args.update(change)
        n_layers = args.pop("num_layers", len(layers))
        measures = args.pop("measures", names)
        return plan_memory(model, num_tokens, measures, n_layers, **args)

    budget = int(0.9 * (limit if limit is not None else available_memory(model.device)))
    need = plan()
    disk_free = shutil.disk_usage(_existing_parent(out)).free if out is not None else None
    fits_memory = need.memory <= budget
    fits_disk = disk_free is None or need.maps_disk <= 0.95 * disk_free
    if fits_memory and fits_disk:
        return
    options = []
    for label, change in (
        ("--out DIR (stream the maps to disk)", dict(streamed=True, reductions=True)),
        ("--no-maps (reductions only)", dict(maps=False, streamed=False, reductions=True)),
        (
            "--storage-dtype float16",
            dict(storage=torch.float16),
        ),
        ("--measures contribution", dict(measures=["contribution"])),
        ("--layers with 3 layers", dict(num_layers=min(3, len(layers)))),
    ):
        alt = plan(**change)
        disk_ok = disk_free is None or alt.maps_disk <= 0.95 * disk_free
        if alt.memory <= budget and disk_ok:
            disk = f", {_gb(alt.maps_disk)} on disk" if alt.maps_disk else ""
            options.append(f"{label}: about {_gb(alt.memory)} in memory{disk}")
    what = (
        f"about {_gb(need.memory)} of memory; {_gb(budget)} are usable"
        if not fits_memory
        else f"about {_gb(need.maps_disk)} on disk; {_gb(disk_free or 0)} are free at {out}"
    )
    fix = "\n  ".join(options) if options else "none of the usual options fits: trace fewer tokens"
    raise MemoryPreflightError(
        f"tracing {num_tokens} tokens with {len(layers)} layers and measures "
        f"{', '.join(names)} needs {what}. Options that fit:\n  {fix}"
    )


def _existing_parent(path: Path | None) -> Path:
    p = Path(path or ".").resolve()
    while not p.exists():
        p = p.parent
    return p
