"""The sums a trace folds each block of a measure into, plain or compiled.

A traced block of a weight measure ``w`` ``(H, I, K)`` (heads, queries, keys) is reduced
to a handful of vectors (:class:`BlockSums`): column sums (the token scores' numerators),
row sums, Σ|w| and Σ|w| ln|w| over the keys after the first (the entropies), |w_i0|, and
the maxima of chunks of keys (the top-k search). Written as separate torch calls each is
one pass over the block; at long context, where a block holds ``H × I × T`` numbers,
these passes are most of a traced layer's cost beyond its matrix products.

Two implementations of one contract:

* :func:`block_sums`: plain torch, one call per sum (the reference, and the default);
* :func:`fused_measure_sums` (every traced measure at once, read from the stored factors
  α, p, č by the registry's recipes, so no derived block is built; each measure's sums
  are :func:`fused_block_sums`): the same sums written for ``torch.compile``, whose
  inductor backend fuses them into loops over the block: C++ on CPUs, Triton on GPUs.
  Compiled once per process for any block shape (dynamic shapes; torch caches the
  generated code on disk).

:class:`Kernels` says which a trace uses (``"torch"``, ``"compiled"`` or ``"auto"``); the
trace's recorder falls back to the plain path, with a warning, when compilation fails (no
C++ compiler, say). Tests
compare the two (tests/test_kernels.py). benchmarks/bench_kernels.py measured the choice:
on CPUs the compiled trace was slower (the fused graph sums every field of every measure
and reads the top keys' candidates again through the recipes, where the plain path sums
only what each measure needs: docs/long-contexts.md), so ``"auto"`` does not compile
there; on GPUs the choice waits for benchmarks/bench_gpu.py's ``no-maps-compiled`` row.
"""

# ruff: noqa: F722  (jaxtyping shape strings are not forward references)

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from jaxtyping import Float
from torch import Tensor

from ..defaults import KERNEL_PRECISIONS, KERNELS  # light: the CLI shows the choices before torch
from .layer import Factors
from .registry import get_measure

#: chunks of keys whose maxima narrow the top-k search (see :func:`top_indices`)
CHUNK = 32
#: the devices where ``kernels="auto"`` compiles, by measurement: none so far. On CPUs the
#: compiled loops measured slower than plain torch (benchmarks/bench_kernels.py,
#: docs/long-contexts.md); on GPUs they are unmeasured (benchmarks/bench_gpu.py's
#: ``no-maps-compiled`` row decides, and "cuda" joins this set if it wins there)
COMPILE_ON: frozenset[str] = frozenset()
#: and from this many tokens on (below, compiling costs more than it could save: a first
#: compile takes 10-60 s)
COMPILE_FROM_TOKENS = 2048


class BlockSums(NamedTuple):
    """The sums of one block ``w`` ``(H, I, K)``; ``a = |w|`` (``w`` for measures ≥ 0)."""

    col: Tensor  # (H, K) Σ_i w_ij
    col_abs: Tensor | None  # (H, K) Σ_i a_ij (plain path: only when asked for)
    row: Tensor  # (H, I) Σ_j w_ij
    rest_total: Tensor  # (H, I) Σ_{j ≥ 1} a_ij (keys after the block's first)
    rest_log: Tensor  # (H, I) Σ_{j ≥ 1} a_ij ln a_ij
    first: Tensor  # (H, I) a_i0 (the block's first key)
    maxima: Tensor | None  # (H, I, ⌈K / CHUNK⌉) max of a over each chunk of keys, or None
    first_value: Tensor  # (H, I) w_i0, signed


def chunk_maxima(a: Float[Tensor, "*lead k"], chunk: int = CHUNK) -> Tensor:
    """``(…, ⌈K / chunk⌉)``: the maximum of each run of ``chunk`` keys (the last may be
    shorter)."""
    k = a.shape[-1]
    whole = k // chunk * chunk
    maxima = a[..., :whole].unflatten(-1, (whole // chunk, chunk)).amax(-1)
    if whole < k:
        maxima = torch.cat([maxima, a[..., whole:].amax(-1, keepdim=True)], dim=-1)
    return maxima


def block_sums(
    w: Float[Tensor, "h i k"],
    *,
    signed: bool = True,
    maxima: bool = True,
    col_abs: bool = True,
    a: Tensor | None = None,
    log_terms: tuple[Tensor, Tensor, Tensor | None] | None = None,
) -> BlockSums:
    """The reference: each sum one torch call. ``signed=False`` promises ``w ≥ 0`` (then
    ``a`` is ``w`` itself and ``col_abs`` is ``col``); ``maxima=False`` skips the chunk
    maxima, ``col_abs=False`` the column sums of ``a`` (only ``|·|`` of a measure needs
    them: ihc of the contribution). ``a``: ``|w|`` where the caller has it already; a
    large signed block without it is summed in one pass that never makes ``|w|`` whole.
    ``log_terms``: ``(s, lse, c)`` with ``ln w_ij = s_ij − lse_i + c_j`` wherever w > 0
    (``(H, I, K)``, ``(H, I)``, ``(H, K)`` or None; a measure's
    :attr:`~.registry.Measure.log_terms`): the entropies' sums then take no logarithm."""
    from .aggregates import LOG_CHUNK_BYTES, sums_and_a_log_a

    if signed and a is None and log_terms is None and _one_pass(w, LOG_CHUNK_BYTES):
        return signed_block_sums(w, CHUNK, maxima, col_abs, LOG_CHUNK_BYTES)
    if a is None:
        a = w.abs() if signed else w
    logits = None if log_terms is None else (log_terms[0][..., 1:], log_terms[1])
    rest_total, rest_log = sums_and_a_log_a(a[..., 1:], logits=logits)
    if logits is not None and not bool(torch.isfinite(rest_log).all()):
        log_terms = None  # a score of -inf (0 · -inf): this block takes the log pass
        rest_total, rest_log = sums_and_a_log_a(a[..., 1:])
    assert rest_total is not None
    key_log = None if log_terms is None else log_terms[2]
    if key_log is not None:  # + Σ_{j ≥ 1} w_ij c_j: c_0 set to 0, one product per head
        c = key_log.to(a.dtype).clone()
        c[:, 0] = 0
        rest_log = rest_log + torch.bmm(c[:, None, :], a.transpose(1, 2))[:, 0]
    col, first = w.sum(-2), a[..., 0]
    return BlockSums(
        col=col,
        col_abs=(a.sum(-2) if signed else col) if col_abs else None,
        row=w.sum(-1) if signed else rest_total + first,
        rest_total=rest_total,
        rest_log=rest_log,
        first=first,
        maxima=chunk_maxima(a) if maxima else None,
        first_value=w[..., 0],
    )


def _one_pass(w: Tensor, chunk_bytes: int) -> bool:
    """Whether a block is summed in one pass of cached row chunks
    (:func:`signed_block_sums`): a 3-d block, larger than a chunk, outside
    autograd."""
    return w.dim() == 3 and not w.requires_grad and w.numel() * w.element_size() > chunk_bytes


def signed_block_sums(
    w: Float[Tensor, "h i t"], chunk: int, maxima: bool, col_abs: bool, chunk_bytes: int
) -> BlockSums:
    """:func:`block_sums` of a signed block ``w`` ``(H, I, T)`` (``a = |w|``) in one pass
    over the block: Σ_i w_ij and (``col_abs``) Σ_i a_ij ``(H, T)``; Σ_j w_ij, Σ_{j≥1} a_ij
    and Σ_{j≥1} a_ij ln a_ij ``(H, I)``; and (``maxima``) the maxima of a over runs of
    ``chunk`` keys ``(H, I, ⌈T / chunk⌉)`` (:func:`chunk_maxima`).

    The queries are taken ``chunk_bytes`` at a time (every head's rows): |w| goes into one
    reused buffer and every sum reads it while it is still in cache, so the block is read
    from memory once and ``|w|`` is never made whole (a third faster than a pass per sum
    on a 9 × 56 × 8,192 block, one thread)."""
    h, i, t = w.shape
    tiny = torch.finfo(w.dtype).tiny
    step = max(1, chunk_bytes // max(1, h * t * w.element_size()))
    col = w.new_zeros(h, t)
    col_a = w.new_zeros(h, t) if col_abs else None
    row, rest_total, rest_log = (w.new_empty(h, i) for _ in range(3))
    peaks = w.new_empty(h, i, -(-t // chunk)) if maxima else None
    buf_a = w.new_empty(h, min(step, i), t)
    buf_log = w.new_empty(h, min(step, i), t - 1)
    part = w.new_empty(h, t)
    for r in range(0, i, step):
        q = slice(r, r + step)
        rows = w[:, q]
        n = rows.shape[1]
        a = torch.abs(rows, out=buf_a[:, :n])
        col += torch.sum(rows, 1, out=part)
        if col_a is not None:
            col_a += torch.sum(a, 1, out=part)
        torch.sum(rows, -1, out=row[:, q])
        rest = a[..., 1:]
        torch.sum(rest, -1, out=rest_total[:, q])
        log2 = torch.clamp_min(rest, tiny, out=buf_log[:, :n]).log2_()
        rest_log[:, q] = torch.linalg.vecdot(rest, log2)
        if peaks is not None:
            peaks[:, q] = chunk_maxima(a, chunk)
    first_value = w[..., 0]
    return BlockSums(
        col, col_a, row, rest_total, rest_log * math.log(2), first_value.abs(), peaks, first_value
    )


def fused_block_sums(w: Float[Tensor, "h i k"]) -> tuple[Tensor, ...]:
    """Every field of :class:`BlockSums` (maxima included) as plain tensor maths that
    inductor fuses: the key-wise sums and maxima share one loop, the query-wise sums
    another. Returns a tuple in :class:`BlockSums` order."""
    a = w.abs()
    rest = a[..., 1:]
    ln2 = math.log(2.0)
    rest_log = (rest * rest.clamp_min(torch.finfo(w.dtype).tiny).log2()).sum(-1) * ln2
    return (
        w.sum(-2),
        a.sum(-2),
        w.sum(-1),
        rest.sum(-1),
        rest_log,
        a[..., 0],
        chunk_maxima(a),
        w[..., 0],
    )


def check_precision(choice: str, precision: str) -> None:
    """A ``ValueError`` naming the fix when ``precision`` is unknown or asked of kernels
    that do not take it (only the tiled Triton kernels multiply on tensor cores)."""
    if precision not in KERNEL_PRECISIONS:
        raise ValueError(
            f"kernel_precision={precision!r}: choose one of {', '.join(KERNEL_PRECISIONS)}"
        )
    if precision != "ieee" and choice != "triton":
        raise ValueError(
            f"kernel_precision={precision!r} applies to kernels='triton' (the tiled "
            f"kernels' tensor-core products); kernels={choice!r} computes in the trace's "
            "dtype: choose kernels='triton' or leave kernel_precision='ieee'"
        )


class Kernels:
    """Which implementation reduces blocks: ``"torch"``, ``"compiled"`` or ``"auto"``
    (compiled on the devices of :data:`COMPILE_ON` from :data:`COMPILE_FROM_TOKENS` tokens
    on, else plain). A compile that fails warns once and leaves the plain path in use.
    ``"triton"``: no blocks at all; traced layers are reduced whole by the tiled kernels
    of :mod:`.tiled` (traces without maps only), whose products are ``precision``
    (:data:`~..defaults.KERNEL_PRECISIONS`; the other kernels compute in the trace's
    dtype and take ``"ieee"`` only)."""

    def __init__(
        self,
        choice: str = "torch",
        num_tokens: int = 0,
        device: torch.device | str = "cpu",
        precision: str = "ieee",
    ) -> None:
        if choice not in KERNELS:
            raise ValueError(f"kernels={choice!r}: choose one of {', '.join(KERNELS)}")
        check_precision(choice, precision)
        self.choice = choice
        self.precision = precision
        self.tiled = choice == "triton"  # whole layers by measures.tiled, no blocks
        self.compiled = choice == "compiled" or (
            choice == "auto"
            and torch.device(device).type in COMPILE_ON
            and num_tokens >= COMPILE_FROM_TOKENS
        )

    def __repr__(self) -> str:
        return f"Kernels({self.choice!r}, compiled={self.compiled})"

    def failed(self, err: Exception) -> None:
        """A compiled kernel failed: warn once and use the plain path from now on."""
        warnings.warn(
            f"the compiled reductions failed ({type(err).__name__}: {err}); using the plain "
            "torch path (kernels='torch'), which gives the same results more slowly",
            RuntimeWarning,
            stacklevel=3,
        )
        self.compiled = False


# ---- every measure of a trace from its stored factors, in one compiled graph -------------
def fused_measure_sums(
    measures: Sequence[str], stored: Sequence[str]
) -> Callable[..., tuple[Tensor, ...]]:
    """A function of the stored maps' blocks and the per-layer norms that returns the sums
    of every measure in ``measures`` (each stored, or read from the stored maps by its
    registry recipe, :attr:`~.registry.Measure.recipes`), without building the derived
    blocks: under ``torch.compile`` the recipes' arithmetic runs inside the loops that
    sum, so a block of α, p and č is read once along the keys and once along the queries
    whatever the number of measures.

    Arguments of the returned function: the ``stored`` blocks ``(H, I, K)`` in that order,
    then ``value_norm`` ``(H, 1, K)``, ``output_norm`` ``(1, I, 1)`` and ``valid``
    ``(1, I, K)`` (as :class:`~.layer.Factors` holds them). It returns, per measure in
    order, the 8 :class:`BlockSums` fields for a weight, or (Σ_i w, Σ_j w, w_i0) for a
    measure that is not one.
    """
    derive = [deriver(name, stored) for name in measures]
    weights = [get_measure(name).is_weight for name in measures]
    names = tuple(stored)

    def sums(*tensors: Tensor) -> tuple[Tensor, ...]:
        *blocks, value_norm, output_norm, valid = tensors
        f = Factors(dict(zip(names, blocks, strict=True)), value_norm, output_norm, valid)
        out: list[Tensor] = []
        for fn, weight in zip(derive, weights, strict=True):
            w = fn(f)
            out.extend(fused_block_sums(w) if weight else (w.sum(-2), w.sum(-1), w[..., 0]))
        return tuple(out)

    return sums


def deriver(name: str, stored: Sequence[str]) -> Callable[[Factors], Tensor]:
    """How ``name`` is read from the ``stored`` maps: the map itself, or its recipe."""
    if name in stored:
        return lambda f: f.maps[name]
    recipe = get_measure(name).recipe(stored)
    if recipe is None:
        raise ValueError(f"measure {name!r} cannot be read from the maps {', '.join(stored)}")
    return recipe.derive


_FUSED: dict[tuple[tuple[str, ...], tuple[str, ...]], Callable[..., tuple[Tensor, ...]]] = {}


def compiled_measure_sums(
    measures: Sequence[str], stored: Sequence[str]
) -> Callable[..., tuple[Tensor, ...]]:
    """:func:`fused_measure_sums` under ``torch.compile``, made once per process and
    (measures, stored maps)."""
    key = (tuple(measures), tuple(stored))
    if key not in _FUSED:
        plain = fused_measure_sums(*key)
        _FUSED[key] = torch.compile(plain, dynamic=True, fullgraph=True)
    return _FUSED[key]
