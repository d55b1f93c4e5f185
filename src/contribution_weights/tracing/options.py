"""Options of a trace, declared once: :func:`~.run.trace` and ``cw trace`` share them."""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from ..capture import DEFAULT_BLOCK_BYTES
from ..defaults import DEFAULT_TOP_K, KERNELS
from ..fields import as_bytes
from ..measures.kernels import check_precision


@dataclass
class TraceOptions:
    """Options shared by :func:`trace` and ``cw trace``.

    Attributes:
        measures: ``"all"`` (every measure but ``distance``, ``ihc`` and ``projection``) or names.
        layers: model layers to trace (negative indices count from the end); None = all.
        max_tokens: longest sequence accepted; default: the model's context length.
        truncate: keep the first ``max_tokens`` tokens of a longer text instead of failing.
        compute_dtype: ``"float32"`` (default) or ``"float64"``.
        block_bytes: memory bound for one block of attention scores per layer.
        maps: keep the ``T × T`` maps (False: only per-(layer, head) reductions).
        storage_dtype: dtype the maps are kept in (default: the compute dtype);
            ``"float16"``/``"bfloat16"`` halve memory and disk.
        top_k: keys kept per query in the reductions.
        memory_limit: bytes the trace may use (default: the memory available now); a
            number or text such as ``"8G"`` (so is ``block_bytes``).
        exact_inputs: run the layers that are not traced through eager attention too, so
            the traced ones see bit for bit the activations of an all-eager forward
            (default: the model's sdpa kernel, faster; activations then differ from eager's
            by float rounding, ~1e-7 relative in float32).
        kernels: how blocks are reduced (token sums, entropies, top-k search): ``"torch"``
            (plain), ``"compiled"`` (fused by ``torch.compile``) or ``"auto"`` (the one
            measured faster on the device: plain torch on CPUs, where compiling measured
            slower, and on GPUs until measured there), or ``"triton"`` (``maps=False``
            only: each traced layer reduced whole by the tiled kernels of
            ``measures.tiled``, FlashAttention-style, no ``T × T`` map in memory; meant
            for GPUs, interpreted and slow on CPUs). All give the same reductions to
            float rounding.
        kernel_precision: the products of ``kernels="triton"``: ``"ieee"`` (float32,
            the default), ``"tf32"`` or ``"bf16"`` (tensor-core operands, float32
            accumulation; faster on GPUs, to the error budget docs/long-contexts.md
            states).
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
    kernels: str = "auto"
    kernel_precision: str = "ieee"

    def as_kwargs(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def of(
        cls, options: TraceOptions | None = None, overrides: Mapping[str, Any] | None = None
    ) -> TraceOptions:
        """``options`` (default: the defaults) with ``overrides`` by name; an unknown name
        is a ``TypeError`` that lists the valid ones (and the nearest spelling)."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(overrides or {}) - set(names))
        if unknown:
            close = difflib.get_close_matches(unknown[0], names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(
                f"trace() got unknown option {unknown[0]!r}{hint}; its options are "
                f"{', '.join(names)}, out, overwrite and progress"
            )
        return replace(options or cls(), **dict(overrides or {}))

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, not {self.max_tokens}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels={self.kernels!r}: choose one of {', '.join(KERNELS)}")
        check_precision(self.kernels, self.kernel_precision)
        # sizes as numbers or as text ("8G", "32M"), as the command line takes them
        for name in ("block_bytes", "memory_limit"):
            value = getattr(self, name)
            if value is not None:
                try:
                    setattr(self, name, as_bytes(value))
                except ValueError as err:
                    raise ValueError(f"{name}: {err}") from None
