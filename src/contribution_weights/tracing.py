"""``trace``: one forward pass that records the requested measures, per layer and head.

The forward runs under :func:`~.capture.capturing` with a :class:`TraceRecorder`
observer. For each traced layer and block of queries the recorder builds the pure-maths
:class:`~.measures.layer.LayerTensors` in the compute dtype (float32 by default, even for
bf16/fp16 models) and

* writes the *stored* measures (:func:`~.measures.registry.stored_measures`) into a map
  store: in memory (:class:`~.storage.DenseMaps`) or, with ``out=DIR``, straight to disk
  (:class:`~.storage.PackedMaps`), so that peak memory is about one block of one layer;
* with ``maps=False``, or when streaming, folds every requested measure into per-(layer,
  head) reductions (:mod:`~.measures.reductions`) instead of or beside the maps;
* keeps the per-layer vectors (norms, flags, bias share) derived measures are read from.

Layers that are not traced go to the model's own sdpa kernel. Before anything is
allocated, :func:`plan_memory` estimates what the trace needs and refuses, with the
options that would fit, when it would not (:class:`MemoryPreflightError`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, overload

import torch
from torch import Tensor

from .capture import (
    DEFAULT_BLOCK_BYTES,
    LayerCall,
    capturing,
    check_all_layers_seen,
    rows_per_block,
)
from .inputs import InputError, encode, resolve_layers, token_strings
from .loading import LoadedModel
from .measures.reductions import DEFAULT_TOP_K, ReductionAccumulator, follows
from .measures.registry import (
    AbsoluteOf,
    RankOne,
    RowScaled,
    get_measure,
    resolve_measures,
    stored_measures,
)
from .results import Trace, prepare_folder, write_metadata
from .storage import DenseMaps, MapStore, PackedMaps, dtype_name, is_causal, storage_dtype

_COMPUTE_DTYPES = {"float32": torch.float32, "float64": torch.float64}


class MemoryPreflightError(InputError):
    """A trace would not fit in memory or on disk; the message lists options that fit."""


@dataclass
class TraceOptions:
    """Options shared by :func:`trace` and ``cw trace``.

    Attributes:
        measures: ``"all"`` (every measure but ``distance`` and ``ihc``) or names.
        layers: model layers to trace (negative indices count from the end); None = all.
        max_tokens: longest sequence accepted; default: the model's context length.
        truncate: keep the first ``max_tokens`` tokens of a longer text instead of failing.
        compute_dtype: ``"float32"`` (default) or ``"float64"``.
        block_bytes: memory bound for one block of attention scores per layer.
        maps: keep the ``T × T`` maps (False: only per-(layer, head) reductions).
        storage_dtype: dtype the maps are kept in (default: the compute dtype);
            ``"float16"``/``"bfloat16"`` halve memory and disk.
        top_k: keys kept per query in the reductions.
        memory_limit: bytes the trace may use (default: the memory available now).
        exact_inputs: run the layers that are not traced through eager attention too, so
            the traced ones see bit for bit the activations of an all-eager forward
            (default: the model's sdpa kernel, faster; activations then differ from eager's
            by float rounding, ~1e-7 relative in float32).
    """

    measures: str | Sequence[str] = "all"
    layers: Sequence[int] | None = None
    max_tokens: int | None = None
    truncate: bool = False
    compute_dtype: str = "float32"
    block_bytes: int = DEFAULT_BLOCK_BYTES
    maps: bool = True
    storage_dtype: str | None = None
    top_k: int = DEFAULT_TOP_K
    memory_limit: int | None = None
    exact_inputs: bool = False

    def as_kwargs(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TraceRecorder:
    """Observer writing the traced layers' stored maps, reductions and vectors."""

    measures: list[str]
    layers: list[int]
    num_tokens: int
    dtype: torch.dtype
    store: MapStore | None = None
    reducer: ReductionAccumulator | None = None
    vectors: dict[str, Tensor] = field(default_factory=dict)
    progress: Any = None  # a bar advanced once per block of queries
    blocks_per_layer: int = 1
    eager_everywhere: bool = False  # untraced layers too (see TraceOptions.exact_inputs)

    key_spans = True  # blocks come narrowed to the keys their queries can see

    def __post_init__(self) -> None:
        self._position = {layer: pos for pos, layer in enumerate(self.layers)}
        self.stored = list(self.store.names) if self.store is not None else []

    def wants(self, layer_idx: int) -> bool:
        return self.eager_everywhere or layer_idx in self._position

    def skipped(self, call: LayerCall) -> None:
        if self.progress is not None:
            self.progress.update(self.blocks_per_layer)

    def _allocate(self, call: LayerCall) -> None:
        n, h, t = len(self.layers), call.num_heads, self.num_tokens
        device, dtype = call.query.device, self.dtype
        self.vectors = {
            "bias_share": torch.zeros(n, t, dtype=dtype, device=device),
            "degenerate": torch.zeros(n, t, dtype=torch.bool, device=device),
            "degenerate_heads": torch.zeros(n, h, t, dtype=torch.bool, device=device),
            "zero_values": torch.zeros(n, h, t, dtype=torch.bool, device=device),
            "value_norm": torch.zeros(n, h, t, dtype=dtype, device=device),
            "output_norm": torch.zeros(n, t, dtype=dtype, device=device),
            "key_start": torch.zeros(n, t, dtype=torch.int32, device=device),
            "key_stop": torch.zeros(n, t, dtype=torch.int32, device=device),
        }

    def observe(self, call: LayerCall, rows: slice, probs: Tensor) -> None:
        pos = self._position.get(call.layer_idx)
        if pos is None:
            return
        if not self.vectors:
            self._allocate(call)
        keys = call.keys if call.keys is not None else slice(0, call.k_len)
        k0 = keys.start
        lt = call.layer_tensors(rows, probs, self.dtype, keys=call.keys)
        start, stop = _key_range(lt.valid[0], call.layer_idx, rows)
        v = self.vectors
        v["key_start"][pos, rows] = start + k0
        v["key_stop"][pos, rows] = stop + k0
        store = self.store
        if store is not None and rows.start == 0:
            causal = is_causal(v["key_stop"][pos, rows])
            store.start_layer(pos, causal=causal and call.q_len == call.k_len)
        computed: dict[str, Tensor] = {}
        for name in self.stored:
            assert store is not None
            measure = get_measure(name)
            dest = store.destination(name, pos, rows, keys, self.dtype)
            if dest is not None and measure.writes_out:
                computed[name] = measure.compute(lt, out=dest[None])[0]
            else:
                computed[name] = measure.compute(lt)[0]
                store.write(name, pos, rows, computed[name], k0)
        if self.reducer is not None:
            self._reduce(lt, pos, rows, computed, k0)
        v["bias_share"][pos, rows] = lt.bias_share[0]
        v["degenerate"][pos, rows] = lt.degenerate[0]
        v["degenerate_heads"][pos, :, rows] = lt.degenerate_heads[0]
        v["output_norm"][pos, rows] = lt.output_norm[0]
        v["zero_values"][pos, :, keys] = lt.zero_values[0]
        v["value_norm"][pos, :, keys] = lt.value_norm[0]
        if store is not None and rows.stop == call.q_len:
            store.finish_layer(pos)
        if self.progress is not None:
            self.progress.update(1)

    def _reduce(self, lt: Any, pos: int, rows: slice, computed: dict[str, Tensor], k0: int) -> None:
        """Fold this block into the reductions. A measure whose algebra says how it follows
        from another traced measure (a row scaling, an absolute value) reuses that one's
        block; a rank-one measure needs no block at all (see ReductionAccumulator)."""
        assert self.reducer is not None
        red, q0 = self.reducer, rows.start
        blocks: dict[str, Tensor] = {}  # each computed measure's block
        magnitudes: dict[str, Tensor] = {}  # and its |block|, as add() returns it
        later = []
        for name in self.measures:
            algebra = get_measure(name).algebra
            if isinstance(algebra, RankOne):
                key_f, query_f = algebra.key_factor(lt)[0], algebra.query_factor(lt)[0]
                red.add_rank_one(name, pos, q0, key_f, query_f, lt.valid[0], k0)
            elif follows(name, self.measures) is not None:
                later.append((name, algebra))
            else:
                w = computed.get(name)
                if w is None:
                    w = get_measure(name).compute(lt)[0]
                magnitudes[name] = red.add(name, pos, q0, w, k0)
                blocks[name] = w
        for name, algebra in later:
            assert isinstance(algebra, RowScaled | AbsoluteOf)
            if isinstance(algebra, RowScaled):
                scale = algebra.scale(lt)[0]
                red.add_row_scaled(name, algebra.base, pos, q0, blocks[algebra.base], scale, k0)
            else:
                red.add_abs_of(name, algebra.base, pos, q0, magnitudes[algebra.base], k0)


def _key_range(valid: Tensor, layer: int, rows: slice) -> tuple[Tensor, Tensor]:
    """Per query, the first and one-past-last key it may attend to; the keys between must
    all be allowed (causal and sliding-window masks are; others are refused)."""
    t = valid.shape[-1]
    count = valid.sum(-1)
    start = valid.int().argmax(-1)
    stop = t - valid.flip(-1).int().argmax(-1)
    stop = torch.where(count > 0, stop, start)
    if not bool((stop - start == count).all()):
        from .capture import CaptureError

        raise CaptureError(
            f"layer {layer}: some query attends to keys that are not one contiguous range "
            "(a padded or packed batch?); trace one unpadded sequence at a time"
        )
    return start.to(torch.int32), stop.to(torch.int32)


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


# ---- the entry point ----------------------------------------------------------------------
TextInput = str | Sequence[int] | Tensor


@overload
def trace(
    model: LoadedModel,
    inputs: TextInput,
    *,
    measures: str | Sequence[str] = ...,
    layers: Sequence[int] | None = ...,
    max_tokens: int | None = ...,
    truncate: bool = ...,
    compute_dtype: str | torch.dtype = ...,
    block_bytes: int = ...,
    maps: bool = ...,
    storage_dtype: str | torch.dtype | None = ...,
    top_k: int = ...,
    memory_limit: int | None = ...,
    exact_inputs: bool = ...,
    out: str | Path | None = ...,
    progress: bool | None = ...,
) -> Trace: ...


@overload
def trace(
    model: LoadedModel,
    inputs: list[str] | tuple[str, ...] | list[list[int]] | list[Tensor],
    *,
    measures: str | Sequence[str] = ...,
    layers: Sequence[int] | None = ...,
    max_tokens: int | None = ...,
    truncate: bool = ...,
    compute_dtype: str | torch.dtype = ...,
    block_bytes: int = ...,
    maps: bool = ...,
    storage_dtype: str | torch.dtype | None = ...,
    top_k: int = ...,
    memory_limit: int | None = ...,
    exact_inputs: bool = ...,
    out: str | Path | None = ...,
    progress: bool | None = ...,
) -> list[Trace]: ...


def trace(
    model: LoadedModel,
    inputs: Any,
    *,
    measures: str | Sequence[str] = "all",
    layers: Sequence[int] | None = None,
    max_tokens: int | None = None,
    truncate: bool = False,
    compute_dtype: str | torch.dtype = "float32",
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    maps: bool = True,
    storage_dtype: str | torch.dtype | None = None,
    top_k: int = DEFAULT_TOP_K,
    memory_limit: int | None = None,
    exact_inputs: bool = False,
    out: str | Path | None = None,
    progress: bool | None = None,
) -> Trace | list[Trace]:
    """Trace a text or token ids; a list of texts or of id lists gives a list of traces.

    Returns a :class:`~.results.Trace`. See :class:`TraceOptions` for the arguments.
    ``out``: a folder to stream the trace to as it is computed (maps go to disk layer by
    layer; the returned trace reads them lazily). With a list of inputs, each trace goes
    to ``out/NNNN``. ``progress``: a bar over layers and blocks of queries (default: shown
    once the trace has run for two seconds).
    """
    kwargs: dict[str, Any] = dict(
        measures=measures,
        layers=layers,
        max_tokens=max_tokens,
        truncate=truncate,
        compute_dtype=compute_dtype,
        block_bytes=block_bytes,
        maps=maps,
        storage_dtype=storage_dtype,
        top_k=top_k,
        memory_limit=memory_limit,
        exact_inputs=exact_inputs,
    )
    if _is_batch(inputs):
        from .progress import bar

        items = list(inputs)
        outs = [None if out is None else Path(out) / f"{k:04d}" for k in range(len(items))]
        return [
            trace(model, item, out=o, progress=False, **kwargs)
            for item, o in zip(
                bar(items, desc="trace", unit="text", disable=len(items) < 2), outs, strict=True
            )
        ]
    if not isinstance(model, LoadedModel):
        raise TypeError(
            "trace() takes the LoadedModel returned by cw.load_model(); wrap your own model "
            "as cw.LoadedModel(model=..., tokenizer=..., name=...)"
        )
    dtype = _COMPUTE_DTYPES.get(compute_dtype) if isinstance(compute_dtype, str) else None
    dtype = dtype or (compute_dtype if isinstance(compute_dtype, torch.dtype) else None)
    if dtype not in (torch.float32, torch.float64):
        raise InputError(f"compute_dtype must be float32 or float64, not {compute_dtype!r}")
    try:
        storage = storage_dtype_of(storage_dtype, dtype)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    if top_k < 0:
        raise InputError(f"top_k must be 0 or more, not {top_k}")
    if block_bytes < 1:
        raise InputError(f"block_bytes must be at least 1, not {block_bytes}")
    names = resolve_measures(measures)
    layer_list = resolve_layers(layers, model.num_layers)
    ids = encode(model, inputs, max_tokens, truncate)
    folder = None if out is None else Path(out)
    t = ids.numel()
    _preflight(
        model, t, names, layer_list, folder, maps, storage, dtype, top_k, block_bytes, memory_limit
    )
    heads = model.num_heads
    stored = stored_measures(names, storage) if maps else []
    store: MapStore | None = None
    if folder is not None:
        prepare_folder(folder)
    if maps and folder is not None:
        store = PackedMaps(folder / "maps", stored, layer_list, heads, t, storage)
    elif maps:
        store = DenseMaps(stored, len(layer_list), heads, t, storage, model.device)
    reducer = None
    if not maps or folder is not None:
        reducer = ReductionAccumulator(names, len(layer_list), heads, t, top_k, dtype, model.device)
    recorder = TraceRecorder(names, layer_list, t, dtype, store=store, reducer=reducer)
    recorder.eager_everywhere = exact_inputs
    _run(model, ids, recorder, block_bytes, progress)
    if store is not None:
        store.close()
    if store is not None:
        store = store.to("cpu")
    result = Trace(
        input_ids=ids.cpu(),
        tokens=token_strings(model, ids),
        layers=layer_list,
        measures=names,
        num_heads=heads,
        vectors={k: v.cpu() for k, v in recorder.vectors.items()},
        maps=store,
        reductions={} if reducer is None else {k: _cpu(r) for k, r in reducer.results.items()},
        model_name=model.name,
        meta={
            "model_type": model.config.model_type,
            "compute_dtype": dtype_name(dtype),
            "storage_dtype": dtype_name(storage),
            "model_dtype": dtype_name(model.model.dtype),
            "num_layers": model.num_layers,
        },
        path=folder,
    )
    if folder is not None:
        write_metadata(result, folder)
    return result


def storage_dtype_of(value: str | torch.dtype | None, compute: torch.dtype) -> torch.dtype:
    return compute if value is None else storage_dtype(value)


def _cpu(r: Any) -> Any:
    for name, value in vars(r).items():
        if isinstance(value, Tensor):
            setattr(r, name, value.cpu())
    return r


def _is_batch(inputs: Any) -> bool:
    if not isinstance(inputs, (list, tuple)) or not inputs:
        return False
    first = inputs[0]
    return isinstance(first, (str, list, tuple)) or (isinstance(first, Tensor) and first.dim() >= 1)


def _run(
    model: LoadedModel,
    ids: Tensor,
    recorder: TraceRecorder,
    block_bytes: int,
    progress: bool | None,
) -> None:
    from .progress import bar

    t = ids.numel()
    heads = model.num_heads
    rows = rows_per_block(heads, t, block_bytes)
    recorder.blocks_per_layer = -(-t // rows)
    total = model.num_layers * recorder.blocks_per_layer
    show = progress is not False
    pbar = bar(
        total=total,
        desc=f"trace {t} tokens",
        unit="block",
        disable=not show,
        leave=False,
        delay=0 if progress else 2.0,
    )
    recorder.progress = pbar
    try:
        with (
            torch.no_grad(),
            capturing(model.model, [recorder], block_bytes=block_bytes) as session,
        ):
            model.model(
                input_ids=ids[None].to(model.device), use_cache=False, **model.last_logits_only()
            )
            check_all_layers_seen(session, model.num_layers)
    finally:
        pbar.close()
