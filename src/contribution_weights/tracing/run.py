"""``trace``: one forward pass that records the requested measures, per layer and head.

The forward runs under :func:`~contribution_weights.capture.capturing` with a
:class:`~.recorder.TraceRecorder` observer, which writes the *stored* measures
(:func:`~contribution_weights.measures.registry.stored_measures`) into a map store: in
memory (:class:`~.storage.DenseMaps`) or, with ``out=DIR``, straight to disk
(:class:`~.storage.PackedMaps`), so that peak memory is about one block of one layer;
with ``maps=False``, or when streaming, it folds every requested measure into per-(layer,
head) reductions instead of or beside the maps. Layers that are not traced go to the
model's own sdpa kernel. Before anything is allocated, the preflight
(:mod:`.preflight`) refuses a trace that would not fit, naming the options that would.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, overload

import torch
from torch import Tensor

from ..capture import capturing, check_all_layers_seen, rows_per_block
from ..inputs import InputError, encode, resolve_layers, token_strings
from ..loading import LoadedModel
from ..measures.kernels import Kernels
from ..measures.reductions import ReductionAccumulator
from ..measures.registry import resolve_measures, stored_measures
from .folder import refuse_to_replace, staged
from .format import TRACE_ENTRIES
from .options import TraceOptions
from .preflight import _preflight
from .recorder import TraceRecorder
from .result import Trace
from .storage import DenseMaps, MapStore, PackedMaps, dtype_name, storage_dtype

_COMPUTE_DTYPES = {"float32": torch.float32, "float64": torch.float64}
TextInput = str | Sequence[int] | Tensor
BatchInput = list[str] | tuple[str, ...] | list[list[int]] | list[Tensor]


@overload
def trace(
    model: LoadedModel,
    inputs: TextInput,
    options: TraceOptions | None = None,
    *,
    out: str | Path | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
    **overrides: Any,
) -> Trace: ...


@overload
def trace(
    model: LoadedModel,
    inputs: BatchInput,
    options: TraceOptions | None = None,
    *,
    out: str | Path | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
    **overrides: Any,
) -> list[Trace]: ...


def trace(
    model: LoadedModel,
    inputs: Any,
    options: TraceOptions | None = None,
    *,
    out: str | Path | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
    **overrides: Any,
) -> Trace | list[Trace]:
    """Trace a text or token ids; a list of texts or of id lists gives a list of traces.

    Returns a :class:`~.result.Trace`. The options are :class:`~.options.TraceOptions`,
    given as an object, by name (``measures="contribution"``, ``maps=False``, …) or both
    (names override the object). ``out``: a folder to stream the trace to as it is
    computed (maps go to disk layer by layer; the returned trace reads them lazily). With
    a list of inputs, each trace goes to ``out/NNNN``. ``overwrite``: replace a trace
    already in ``out``; without it such a folder is refused before anything is computed
    (:class:`~.folder.TraceExistsError`, naming the earlier trace). ``progress``: a bar
    over layers and blocks of queries (default: shown once the trace has run for two
    seconds).
    """
    opts = TraceOptions.of(options, overrides)
    if _is_batch(inputs):
        from ..progress import bar

        items = list(inputs)
        outs = [None if out is None else Path(out) / f"{k:04d}" for k in range(len(items))]
        return [
            trace(model, item, opts, out=o, overwrite=overwrite, progress=False)
            for item, o in zip(
                bar(items, desc="trace", unit="text", disable=len(items) < 2), outs, strict=True
            )
        ]
    if not isinstance(model, LoadedModel):
        raise TypeError(
            "trace() takes the LoadedModel returned by cw.load_model(); wrap your own model "
            "as cw.LoadedModel(model=..., tokenizer=..., name=...)"
        )
    measures, layers, maps, top_k = opts.measures, opts.layers, opts.maps, opts.top_k
    compute_dtype, block_bytes = opts.compute_dtype, opts.block_bytes
    dtype = _COMPUTE_DTYPES.get(compute_dtype) if isinstance(compute_dtype, str) else None
    dtype = dtype or (compute_dtype if isinstance(compute_dtype, torch.dtype) else None)
    if dtype not in (torch.float32, torch.float64):
        raise InputError(f"compute_dtype must be float32 or float64, not {compute_dtype!r}")
    try:
        storage = storage_dtype_of(opts.storage_dtype, dtype)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    if top_k < 0:
        raise InputError(f"top_k must be 0 or more, not {top_k}")
    if block_bytes < 1:
        raise InputError(f"block_bytes must be at least 1, not {block_bytes}")
    names = resolve_measures(measures)
    if opts.kernels == "triton":
        from ..measures.tiled import refusal

        problem = refusal(maps, names, dtype, model.device)
        if problem is not None:
            raise InputError(problem)
    layer_list = resolve_layers(layers, model.num_layers)
    ids = encode(model, inputs, opts.max_tokens, opts.truncate)
    folder = None if out is None else Path(out)
    if folder is not None and not overwrite:
        refuse_to_replace(folder)  # at once; checked again under the writer's lock
    t = ids.numel()
    _preflight(
        model,
        t,
        names,
        layer_list,
        folder,
        maps,
        storage,
        dtype,
        top_k,
        block_bytes,
        opts.memory_limit,
    )
    heads = model.num_heads
    stored = stored_measures(names, storage) if maps else []
    with contextlib.ExitStack() as stack:
        # on disk: written into a staging folder, moved into place once complete (.folder)
        stage = (
            None
            if folder is None
            else stack.enter_context(staged(folder, TRACE_ENTRIES, overwrite))
        )
        store: MapStore | None = None
        if maps and stage is not None:
            store = PackedMaps(stage / "maps", stored, layer_list, heads, t, storage)
        elif maps:
            store = DenseMaps(stored, len(layer_list), heads, t, storage, model.device)
        reducer = None
        if not maps or stage is not None:
            reducer = ReductionAccumulator(
                names, len(layer_list), heads, t, top_k, dtype, model.device,
                kernels=Kernels(opts.kernels, t, model.device, opts.kernel_precision),
            )  # fmt: skip
        recorder = TraceRecorder(names, layer_list, t, dtype, store=store, reducer=reducer)
        recorder.eager_everywhere = opts.exact_inputs
        _run(model, ids, recorder, block_bytes, progress)
        if store is not None:
            store.close()
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
                "kernels": opts.kernels,
                "kernel_precision": opts.kernel_precision,
                "created": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            },
            path=stage,
        )
        if stage is not None:
            result._write_metadata(stage)
    if folder is not None:
        result.moved_to(folder)
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
    from ..progress import bar

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
