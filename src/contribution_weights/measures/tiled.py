"""A layer's reductions without any ``T × T`` map: tiled, in the manner of FlashAttention.

The plain and compiled reductions (:mod:`.kernels`) fold blocks of maps that the capture
built: ``H × I × T`` numbers per block of queries, written to memory and read back by
every pass. Here nothing of the sort exists. Given a layer's queries, keys and values,

1. :func:`layer_sums` runs FlashAttention's online softmax per head and tile of queries
   (Triton kernel ``forward``): each query's log-sum-exp and head state
   ``z_i^(h) = Σ_j α_ij v_j`` in float32;
2. from those, the per-query and per-key vectors every measure needs, ``O(T · d)``
   each (the layer output ``o_i``, ``W_O^(h)ᵀ o_i / ‖o_i‖²``, ``Gram_h z_i / ‖o_i^(h)‖²``,
   ``‖ṽ_j^(h)‖``), as :class:`~.layer.LayerTensors` defines them;
3. one launch of the kernel ``rows`` and one of ``cols`` for up to
   :data:`~.triton_kernels.SLOTS` measures at once recompute α, p and p^(h) tile by tile
   in registers, once for all of them, and fold every measure into the sums a trace keeps
   (:class:`~.kernels.BlockSums`: row sums, the entropies' sums, the key-0 entry and each
   query's top keys from ``rows``; the per-key column sums from ``cols``).

Memory is ``O(H · T · d_h)``, whatever the length: what users with 8B models at 32k
tokens need on a GPU. Costs: two ``QKᵀ`` tile products per group of measures (one per
direction) besides the forward's. Precision (:data:`PRECISIONS`): ``"ieee"`` multiplies
in float32 (``tl.dot`` in IEEE precision, the default, exact to float32 rounding);
``"tf32"`` and ``"bf16"`` feed the tensor cores rounded operands and accumulate in
float32. The tests compare every precision with the plain path under Triton's
interpreter, on CPU, which rounds the operands the same way.

What it serves: traces without maps (``maps=False``, reductions only) of one sequence,
with the measures of :data:`MEASURES` (rank-one ``relative_norm`` needs no kernel), on
attention whose every query sees one contiguous range of keys (causal, sliding window).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import os
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from ..defaults import KERNEL_PRECISIONS
from .kernels import BlockSums
from .layer import LayerVectors
from .registry import get_measure

#: the measures the kernel computes, by its numbering (see :mod:`.triton_kernels`)
MEASURES = {
    "attention": 0,
    "contribution": 1,
    "intra": 2,
    "projection": 3,
    "cosine": 4,
    "vw": 5,
    "vw_on": 6,
    "ihc": 7,
}
#: queries and keys per tile (halved for heads wider than 128 on GPUs: each tile holds
#: three (queries, head dim) operands in registers); tl.dot needs at least 16
TILE = 64
#: precision of the fused kernels' products (float32 accumulation in every case): IEEE
#: float32, TF32 tensor cores (10-bit mantissa operands), bfloat16 operands
PRECISIONS = {name: i for i, name in enumerate(KERNEL_PRECISIONS)}
#: measures the tiled path serves without a kernel (their reductions are rank one)
RANK_ONE = frozenset({"relative_norm"})


def available() -> str | None:
    """None when Triton can be imported, else why not (said to the user)."""
    if importlib.util.find_spec("triton") is None:  # not imported: see kernels()
        return (
            "kernels='triton' needs the triton package, which is not installed; GPU builds "
            "of torch bring it, else `pip install triton`"
        )
    return None


def refusal(
    maps: bool, measures: list[str], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> str | None:
    """Why a trace with these options cannot use the tiled kernels (None: it can)."""
    if maps:
        return (
            "kernels='triton' computes the reductions without building any map: trace "
            "with maps=False (cw trace --no-maps), or choose kernels='torch'"
        )
    other = [m for m in measures if m not in MEASURES and m not in RANK_ONE]
    if other:
        return (
            f"kernels='triton' does not compute {', '.join(other)}; drop it from the "
            "measures or choose kernels='torch'"
        )
    if dtype != torch.float32:
        return "kernels='triton' computes in float32: use compute_dtype='float32'"
    problem = available()
    if problem is None:
        try:
            kernels(torch.device(device).type == "cpu")
        except RuntimeError as err:
            problem = str(err)
    return problem


@functools.cache
def kernels(interpret: bool) -> SimpleNamespace:
    """The Triton kernels, compiled (tensors on a GPU) or interpreted (on the CPU).

    Triton chooses between the two when it is first imported (``TRITON_INTERPRET``): the
    interpreter is asked for here when CPU tensors come first; once triton is imported
    compiled, CPU tensors cannot be served (a clear error says how to start instead).
    """
    if interpret and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    import triton

    if interpret and not triton.knobs.runtime.interpret:
        raise RuntimeError(
            "kernels='triton' on CPU tensors runs Triton's interpreter, which must be chosen "
            "before triton is imported: set TRITON_INTERPRET=1 in the environment (or trace "
            "on a GPU, or use kernels='torch')"
        )
    if not interpret and triton.knobs.runtime.interpret:
        warnings.warn(
            "TRITON_INTERPRET is set: the tiled kernels run in Triton's interpreter on GPU "
            "tensors too, correctly but slowly; unset it to compile them",
            RuntimeWarning,
            stacklevel=2,
        )
    from . import triton_kernels

    return triton_kernels.build()


@dataclass
class TiledLayer:
    """One layer's float32 inputs and the per-query and per-key vectors of step 2
    (``vectors``, a :class:`~.layer.LayerVectors` of a batch of one).

    Shapes: ``q`` ``(H, T_q, d_h)``; ``k``, ``v`` ``(G, T, d_h)``; ``start``, ``stop``
    ``(T_q,)`` int32 (the keys ``[start_i, stop_i)`` query i sees); ``w_o`` ``(H, d, d_h)``,
    ``b_o`` ``(d,)`` or None, ``gram`` ``(H, d_h, d_h)`` (as :class:`~.layer.LayerTensors`).
    """

    q: Tensor
    k: Tensor
    v: Tensor
    start: Tensor
    stop: Tensor
    scaling: float
    softcap: float | None
    w_o: Tensor
    b_o: Tensor | None
    gram: Tensor
    block_m: int = 0  # queries per tile (0: TILE)
    block_n: int = 0  # keys per tile (0: TILE)
    precision: str = "ieee"  # of the products: ieee, tf32 or bf16 (PRECISIONS)

    def __post_init__(self) -> None:
        h, g = self.q.shape[0], self.k.shape[0]
        if h % g:
            raise ValueError(f"{h} query heads do not divide into {g} KV heads")
        self.q, self.k, self.v = (x.float().contiguous() for x in (self.q, self.k, self.v))
        self.start = self.start.to(torch.int32).contiguous()
        self.stop = self.stop.to(torch.int32).contiguous()
        self.interpret = self.q.device.type == "cpu"
        self.block_d = max(16, 1 << (self.q.shape[-1] - 1).bit_length())
        # registers: at 64 × 64 tiles and d_h = 128 ptxas spills tens of KB (found by an
        # offline compile for sm_90); halved there
        tile = TILE if self.block_d < 128 or self.interpret else TILE // 2
        self.block_m, self.block_n = self.block_m or tile, self.block_n or tile
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"precision must be one of {', '.join(PRECISIONS)}, not {self.precision!r}"
            )
        for size in (self.block_m, self.block_n):
            if size < 16 or size & (size - 1):
                raise ValueError(f"tiles must be powers of two of at least 16, not {size}")
        self.kern = kernels(self.interpret)
        self._spans()
        self._forward()
        self._vectors()

    # ---- geometry of the tiles -------------------------------------------------------
    def _spans(self) -> None:
        """Per tile of queries the keys any of them sees, and per tile of keys the query
        tiles that see any of them (as first and one-past-last query row)."""
        t_q, t_k = self.q.shape[1], self.k.shape[1]
        bm, bn = self.block_m, self.block_n
        pad = (-t_q) % bm
        start = torch.nn.functional.pad(self.start, (0, pad), value=t_k)
        stop = torch.nn.functional.pad(self.stop, (0, pad), value=0)
        self.key_lo = start.view(-1, bm).amin(1).to(torch.int32).contiguous()
        self.key_hi = stop.view(-1, bm).amax(1).to(torch.int32).contiguous()
        self.key_hi = torch.maximum(self.key_hi, self.key_lo)
        # query tile m sees key tile n when key_lo[m] < n1 and key_hi[m] > n0
        n0 = torch.arange(0, t_k, bn, device=self.q.device)
        n1 = (n0 + bn).clamp_max(t_k)
        sees = (self.key_lo[None, :] < n1[:, None]) & (self.key_hi[None, :] > n0[:, None])
        any_ = sees.any(1)
        first = sees.int().argmax(1)
        last = sees.shape[1] - sees.flip(1).int().argmax(1)
        self.query_lo = torch.where(any_, first * bm, 0).to(torch.int32).contiguous()
        self.query_hi = torch.where(any_, last * bm, 0).to(torch.int32).contiguous()

    def _grid(self, axis: int) -> tuple[int, int]:
        h, t_q, t_k = self.q.shape[0], self.q.shape[1], self.k.shape[1]
        return (h, math.ceil(t_q / self.block_m) if axis == 0 else math.ceil(t_k / self.block_n))

    # ---- step 1: log-sum-exp and head states --------------------------------------------
    def _forward(self) -> None:
        h, t_q, d = self.q.shape
        self.lse = torch.empty(h, t_q, dtype=torch.float32, device=self.q.device)
        self.z = torch.empty(h, t_q, d, dtype=torch.float32, device=self.q.device)
        with _on(self.q.device):
            self._launch_forward()

    def _launch_forward(self) -> None:
        h, t_q, d = self.q.shape
        g, t_k = self.k.shape[:2]
        self.kern.forward[self._grid(0)](
            self.q, self.k, self.v, self.start, self.stop, self.key_lo, self.key_hi,
            self.z, self.lse,
            t_q, t_k, d, h // g, self.scaling, self.softcap or 1.0,
            self.q.stride(0), self.q.stride(1), self.k.stride(0), self.k.stride(1),
            self.z.stride(0), self.z.stride(1),
            SOFTCAP=self.softcap is not None, BLOCK_M=self.block_m, BLOCK_N=self.block_n,
            BLOCK_D=self.block_d,
        )  # fmt: skip

    # ---- step 2: the vectors the measures are read from --------------------------------
    def _vectors(self) -> None:
        """:class:`~.layer.LayerVectors` (a batch of one) from ``z`` instead of ``α @ v``;
        the flat ``(H, T, d_h)`` factors the reduce kernel reads."""
        vec = LayerVectors(
            self.v[None], self.w_o.float(),
            None if self.b_o is None else self.b_o.float(),
            head_states=self.z[None], gram=self.gram.float(),
        )  # fmt: skip
        self.back = vec.scaled_back[0].contiguous()
        self.left = vec.scaled_head_left[0].contiguous()
        self.value_norm = vec.value_norm[0].contiguous()
        self.output_norm = vec.output_norm[0].contiguous()
        for small in ("bias_share", "degenerate", "degenerate_heads", "zero_values"):
            getattr(vec, small)  # what the recorder reads, O(H · T) each, kept
        for large in (
            "scaled_back",
            "scaled_head_left",
            "head_states_gram",
            "head_values",
            "output",
        ):
            vec.__dict__.pop(large, None)  # O(T · d) each: taken above or no longer needed
        self.vectors = vec

    # ---- step 3: every measure's sums, one fused pair of launches --------------------
    def all_sums(
        self, names: list[str], top_k: int
    ) -> dict[str, tuple[BlockSums, tuple[Tensor, Tensor] | None]]:
        """The :class:`~.kernels.BlockSums` of every measure in ``names`` that the kernels
        compute (:data:`MEASURES`) over every query and key (no chunk maxima: the top keys
        come with them, largest |w| first, as ``(H, T_q, top_k)`` key indices and signed
        values, None for a measure that is not a weight or when ``top_k`` is 0). One
        launch of ``rows`` and one of ``cols`` per :data:`~.triton_kernels.SLOTS`
        measures: α, p and p^(h) are computed once per tile for all of them."""
        from .triton_kernels import SLOTS

        served = [n for n in names if n in MEASURES]
        out: dict[str, tuple[BlockSums, tuple[Tensor, Tensor] | None]] = {}
        for i in range(0, len(served), SLOTS):
            out.update(self._group_sums(served[i : i + SLOTS], top_k, SLOTS))
        return out

    def sums(self, name: str, top_k: int) -> tuple[BlockSums, tuple[Tensor, Tensor] | None]:
        """One measure's :meth:`all_sums`."""
        return self.all_sums([name], top_k)[name]

    @functools.cached_property
    def operands(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """``q, k, v``, ``W_Oᵀ o_i/‖o_i‖²`` and ``Gram_h z_i/‖o_i^(h)‖²`` as the products
        read them: float32 (IEEE; TF32 on a GPU, rounded to TF32 here under the
        interpreter, which multiplies in float32), or bfloat16 (rounded to nearest)."""
        ops = (self.q, self.k, self.v, self.back, self.left)
        if self.precision == "bf16":
            return tuple(x.to(torch.bfloat16).contiguous() for x in ops)  # type: ignore[return-value]
        if self.precision == "tf32" and self.interpret:
            return tuple(round_tf32(x) for x in ops)  # type: ignore[return-value]
        return ops

    def _group_sums(
        self, group: list[str], top_k: int, slots: int
    ) -> dict[str, tuple[BlockSums, tuple[Tensor, Tensor] | None]]:
        h, t_q, d = self.q.shape
        g, t_k = self.k.shape[:2]
        dev = self.q.device
        numbers = [MEASURES[n] for n in group]
        weights = [get_measure(n).is_weight for n in group]
        k = top_k if any(weights) else 0
        rows = torch.empty(len(group), 5, h, t_q, dtype=torch.float32, device=dev)
        top_a = torch.empty(len(group), h, t_q, max(k, 1), dtype=torch.float32, device=dev)
        top_w = torch.empty_like(top_a)
        top_i = torch.empty(len(group), h, t_q, max(k, 1), dtype=torch.int32, device=dev)
        cols = torch.empty(2 * len(group), h, t_k, dtype=torch.float32, device=dev)
        const = slot_flags(numbers, slots)
        const.update(
            SOFTCAP=self.softcap is not None,
            DOT=PRECISIONS[self.precision],
            INTERPRET=self.interpret,
            BLOCK_M=self.block_m,
            BLOCK_N=self.block_n,
            BLOCK_D=self.block_d,
        )
        q, key, v, back, left = self.operands
        common = (
            q, key, v, back, left, self.start, self.stop, self.lse, self.output_norm,
            self.value_norm,
        )  # fmt: skip
        sizes = (h, t_q, t_k, d, h // g, self.scaling, self.softcap or 1.0)
        strides = (q.stride(0), q.stride(1), key.stride(0), key.stride(1))
        pad = max(1, 1 << (k - 1).bit_length()) if k else 1
        with _on(dev):
            self.kern.rows[self._grid(0)](
                *common, self.key_lo, self.key_hi, rows, top_w, top_a, top_i, *sizes, *strides,
                TOPK=k, TOPK_PAD=pad, **const,
            )  # fmt: skip
            self.kern.cols[self._grid(1)](
                *common, self.query_lo, self.query_hi, cols, *sizes, *strides, **const
            )
        out: dict[str, tuple[BlockSums, tuple[Tensor, Tensor] | None]] = {}
        for slot, (name, weight) in enumerate(zip(group, weights, strict=True)):
            row, rest, rest_log, first, first_value = rows[slot].unbind(0)
            sums = BlockSums(
                col=cols[2 * slot],
                col_abs=cols[2 * slot + 1],
                row=row if get_measure(name).signed else rest + first,
                rest_total=rest,
                rest_log=rest_log,
                first=first,
                maxima=None,
                first_value=first_value,
            )
            if not (k and weight):
                out[name] = (sums, None)
                continue
            order = top_a[slot].argsort(-1, descending=True)
            out[name] = (
                sums,
                (top_i[slot].gather(-1, order).long(), top_w[slot].gather(-1, order)),
            )
        return out


def slot_flags(numbers: Sequence[int], slots: int) -> dict[str, int | bool]:
    """The compile-time switches of the ``rows`` and ``cols`` kernels for measures of these
    numbers (:data:`MEASURES`): the slots ``M0 …`` (-1 where empty) and which per-tile
    quantities they read (α, p, p^(h), ‖ṽ_j‖, ‖o_i‖), so that no tile computes one that
    none of them needs."""
    used = set(numbers)
    flags: dict[str, int | bool] = {
        f"M{i}": (numbers[i] if i < len(numbers) else -1) for i in range(slots)
    }
    flags.update(
        ALPHA=bool(used & {0, 1, 2, 5, 6, 7}),
        P=bool(used & {1, 3, 4, 7}),
        PH=2 in used,
        VNORM=bool(used & {4, 5, 6}),
        ONORM=bool(used & {4, 6}),
    )
    return flags


#: the kernels' integer arrays and the operands ``"bf16"`` reads in bfloat16 (the rest of
#: their capitalised arguments are float32 arrays, lower-case ones scalars)
_INT_ARRAYS = frozenset({"START", "STOP", "KEY_LO", "KEY_HI", "QUERY_LO", "QUERY_HI", "TOP_I"})
_OPERANDS = frozenset({"Q", "K", "V", "BACK", "LEFT"})


def compile_offline(fn: Any, constants: dict[str, Any], capability: int = 90) -> Any:
    """Compile one of the kernels (``triton_kernels.build()``'s ``forward``, ``rows`` or
    ``cols``) for an NVIDIA GPU of this compute capability without one present: Triton's
    front end, its NVIDIA backend and the ptxas it ships. Needs a process in which triton
    was imported without ``TRITON_INTERPRET``; the result's ``asm["ptx"]`` is what ptxas
    reads (registers and spills: benchmarks/kernel_registers.py)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    bf16 = constants.get("DOT") == PRECISIONS["bf16"]
    sig = {}
    for name in fn.arg_names:
        if name in constants:
            sig[name] = "constexpr"
        elif name.isupper():
            sig[name] = (
                "*i32" if name in _INT_ARRAYS else "*bf16" if bf16 and name in _OPERANDS
                else "*fp32"
            )  # fmt: skip
        else:
            sig[name] = "fp32" if name in ("scaling", "softcap") else "i32"
    source = ASTSource(fn, sig, constants)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32))


def round_tf32(x: Tensor) -> Tensor:
    """Float32 ``x`` rounded to TF32 (10 mantissa bits, to nearest, ties to even): the
    operands a TF32 tensor-core product reads, for the interpreter to multiply."""
    bits = x.float().contiguous().view(torch.int32)
    bias = 0xFFF + ((bits >> 13) & 1)
    return ((bits + bias) & ~0x1FFF).view(torch.float32)


def _on(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """Triton launches on the current CUDA device, not the tensors': make it theirs (a
    model split over several GPUs puts layers on different ones)."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()
