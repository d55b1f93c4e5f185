"""``trace``: one forward pass that records every requested measure, per layer and head.

The forward runs under :func:`~.capture.capturing` with a :class:`TraceRecorder`
observer. For each traced layer and block of queries the recorder builds the pure-maths
:class:`~.measures.layer.LayerTensors` in the compute dtype (float32 by default, even
for bf16/fp16 models) and writes each measure into a preallocated ``(L, H, T, T)``
tensor. Layers that are not traced cost nothing beyond eager attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, overload

import torch
from torch import Tensor

from .capture import DEFAULT_BLOCK_BYTES, LayerCall, capturing, check_all_layers_seen
from .inputs import InputError, encode, resolve_layers, token_strings
from .loading import LoadedModel
from .measures.registry import get_measure, resolve_measures
from .results import Trace

_COMPUTE_DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass
class TraceOptions:
    """Options shared by :func:`trace` and ``cw trace``.

    Attributes:
        measures: ``"all"`` or measure names (see ``cw measures``).
        layers: model layers to trace (negative indices count from the end); None = all.
        max_tokens: longest sequence accepted; default: the model's context length.
        truncate: keep the first ``max_tokens`` tokens of a longer text instead of failing.
        compute_dtype: ``"float32"`` (default) or ``"float64"``.
        block_bytes: memory bound for one block of attention scores per layer.
    """

    measures: str | Sequence[str] = "all"
    layers: Sequence[int] | None = None
    max_tokens: int | None = None
    truncate: bool = False
    compute_dtype: str = "float32"
    block_bytes: int = DEFAULT_BLOCK_BYTES

    def as_kwargs(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TraceRecorder:
    """Observer writing the requested measures of the traced layers into tensors."""

    measures: list[str]
    layers: list[int]
    num_tokens: int
    dtype: torch.dtype
    store: dict[str, Tensor] = field(default_factory=dict)
    bias_share: Tensor | None = None
    degenerate: Tensor | None = None
    degenerate_heads: Tensor | None = None
    zero_values: Tensor | None = None
    progress: Any = None  # a tqdm bar advanced once per finished traced layer

    def __post_init__(self) -> None:
        self._position = {layer: pos for pos, layer in enumerate(self.layers)}

    def _allocate(self, call: LayerCall) -> None:
        n, t = len(self.layers), self.num_tokens
        shape = (n, call.num_heads, t, t)
        device = call.query.device
        # every traced layer writes all its rows (check_all_layers_seen fails otherwise), so
        # the storage need not be zero-filled first: a pass over gigabytes at long context
        self.store = {m: torch.empty(shape, dtype=self.dtype, device=device) for m in self.measures}
        self.bias_share = torch.zeros(n, t, dtype=self.dtype, device=device)
        self.degenerate = torch.zeros(n, t, dtype=torch.bool, device=device)
        self.degenerate_heads = torch.zeros(n, call.num_heads, t, dtype=torch.bool, device=device)
        self.zero_values = torch.zeros(n, call.num_heads, t, dtype=torch.bool, device=device)

    def observe(self, call: LayerCall, rows: slice, probs: Tensor) -> None:
        pos = self._position.get(call.layer_idx)
        if pos is None:
            return
        if not self.store:
            self._allocate(call)
        lt = call.layer_tensors(rows, probs, self.dtype)
        for name in self.measures:
            self.store[name][pos, :, rows] = get_measure(name).compute(lt)[0]
        assert self.bias_share is not None and self.degenerate is not None
        assert self.degenerate_heads is not None and self.zero_values is not None
        self.bias_share[pos, rows] = lt.bias_share[0]
        self.degenerate[pos, rows] = lt.degenerate[0]
        self.degenerate_heads[pos, :, rows] = lt.degenerate_heads[0]
        self.zero_values[pos] = lt.zero_values[0]
        if self.progress is not None and rows.stop == call.q_len:
            self.progress.update(1)


@overload
def trace(
    model: LoadedModel,
    inputs: str | Sequence[int] | Tensor,
    *,
    measures: str | Sequence[str] = ...,
    layers: Sequence[int] | None = ...,
    max_tokens: int | None = ...,
    truncate: bool = ...,
    compute_dtype: str | torch.dtype = ...,
    block_bytes: int = ...,
    progress: bool | None = ...,
) -> Trace: ...


@overload
def trace(
    model: LoadedModel,
    inputs: list[str] | tuple[str, ...],
    *,
    measures: str | Sequence[str] = ...,
    layers: Sequence[int] | None = ...,
    max_tokens: int | None = ...,
    truncate: bool = ...,
    compute_dtype: str | torch.dtype = ...,
    block_bytes: int = ...,
    progress: bool | None = ...,
) -> list[Trace]: ...


def trace(
    model: LoadedModel,
    inputs: str | Sequence[int] | Tensor | Sequence[str],
    *,
    measures: str | Sequence[str] = "all",
    layers: Sequence[int] | None = None,
    max_tokens: int | None = None,
    truncate: bool = False,
    compute_dtype: str | torch.dtype = "float32",
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    progress: bool | None = None,
) -> Trace | list[Trace]:
    """Trace a text, token ids, or a list of texts (then a list of traces is returned).

    Returns a :class:`~.results.Trace` whose tensors are ``(len(layers), H, T, T)`` in
    the compute dtype. See :class:`TraceOptions` for the arguments; ``progress`` shows a
    bar over layers (default: for sequences of 512 tokens or more).
    """
    if isinstance(inputs, (list, tuple)) and inputs and isinstance(inputs[0], str):
        kwargs = dict(
            measures=measures,
            layers=layers,
            max_tokens=max_tokens,
            truncate=truncate,
            compute_dtype=compute_dtype,
            block_bytes=block_bytes,
            progress=False,
        )
        from tqdm.auto import tqdm

        texts = tqdm(inputs, desc="trace", unit="text", disable=len(inputs) < 2)
        return [trace(model, text, **kwargs) for text in texts]  # type: ignore[call-overload]
    if not isinstance(model, LoadedModel):
        raise TypeError(
            "trace() takes the LoadedModel returned by cw.load_model(); wrap your own model "
            "as cw.LoadedModel(model=..., tokenizer=..., name=...)"
        )
    dtype = _COMPUTE_DTYPES.get(compute_dtype) if isinstance(compute_dtype, str) else None
    dtype = dtype or (compute_dtype if isinstance(compute_dtype, torch.dtype) else None)
    if dtype not in (torch.float32, torch.float64):
        raise InputError(f"compute_dtype must be float32 or float64, not {compute_dtype!r}")
    names = resolve_measures(measures)
    layer_list = resolve_layers(layers, model.num_layers)
    ids = encode(model, inputs, max_tokens, truncate)  # type: ignore[arg-type]
    recorder = TraceRecorder(names, layer_list, ids.numel(), dtype)
    from tqdm.auto import tqdm

    show = ids.numel() >= 512 if progress is None else progress
    bar = tqdm(total=len(layer_list), desc="trace", unit="layer", disable=not show, leave=False)
    recorder.progress = bar
    try:
        with (
            torch.no_grad(),
            capturing(model.model, [recorder], block_bytes=block_bytes) as session,
        ):
            model.model(input_ids=ids[None].to(model.device), use_cache=False)
            check_all_layers_seen(session, model.num_layers)
    finally:
        bar.close()
    assert recorder.bias_share is not None and recorder.degenerate is not None
    assert recorder.degenerate_heads is not None and recorder.zero_values is not None
    return Trace(
        measures={k: v.cpu() for k, v in recorder.store.items()},
        input_ids=ids.cpu(),
        tokens=token_strings(model, ids),
        layers=layer_list,
        bias_share=recorder.bias_share.cpu(),
        degenerate=recorder.degenerate.cpu(),
        degenerate_heads=recorder.degenerate_heads.cpu(),
        zero_values=recorder.zero_values.cpu(),
        model_name=model.name,
        meta={
            "model_type": model.config.model_type,
            "compute_dtype": str(dtype).removeprefix("torch."),
            "model_dtype": str(model.model.dtype).removeprefix("torch."),
            "num_layers": model.num_layers,
        },
    )
