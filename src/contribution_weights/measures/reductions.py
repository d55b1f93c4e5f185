"""Per-(layer, head) reductions of a measure, accumulated block by block of queries.

A trace that keeps no ``T × T`` map (``maps=False``) still answers the questions people
ask of one: which keys each head relies on, how much weight goes to token 0, how spread
the weights are. :class:`ReductionAccumulator` takes each block of queries of a measure
(``(H, I, T)``, the rows ``first_query … first_query + I − 1``) as the forward produces
it and keeps, per traced layer, head and query or key:

* ``token_sums`` ``(L, H, T)``: Σ over queries i ≥ j of w_ij; divided by the number of
  such queries it is the token score s_j (the mean over i ≥ j that faithfulness ranks by);
* ``first`` and ``row_sum`` ``(L, H, T)``: w_i0 and Σ_j w_ij per query, from which the
  first-token weight of the normalised measure follows (every registered normalisation
  scales a query by a factor computed from its sums over heads and keys);
* ``entropy`` and ``entropy_excl_first`` ``(L, H, T)``: per query, the entropy of
  |w_i·| / Σ|w_i·|, with and without token 0 (query 0 has no key then and is 0);
* ``top_values`` and ``top_keys`` ``(L, H, T, k)``, k slots whatever T is: the k keys
  with the largest weight per query (largest |w| for signed measures, values kept
  signed), in decreasing order of |w| (equal values in no set order); the slots left
  when a query has fewer than k keys of nonzero weight (query i sees at most i + 1 keys)
  hold key −1 and value 0.

Memory is O(L·H·T·k). The same reductions of a full map (``Trace.token_scores`` on a trace
with maps) go through the same code, one layer and block at a time, so the two agree to
float rounding.
"""

# ruff: noqa: F722  (jaxtyping shape strings are not forward references)

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from ..defaults import DEFAULT_TOP_K  # light: the CLI shows it before torch
from .aggregates import (
    entropy_of_rows,
    first_token_weight,
    later_query_mean,
    normalised,
)
from .kernels import CHUNK, BlockSums, Kernels, block_sums, chunk_maxima
from .registry import AbsoluteOf, RowScaled, get_measure

FIELDS = ("token_sums", "first", "row_sum", "entropy", "entropy_excl_first")


@dataclass
class MeasureReductions:
    """The reductions of one measure over the traced layers (see module docstring)."""

    measure: str
    token_sums: Tensor  # (L, H, T)
    first: Tensor  # (L, H, T)
    row_sum: Tensor  # (L, H, T)
    entropy: Tensor  # (L, H, T)
    entropy_excl_first: Tensor  # (L, H, T)
    top_values: Tensor | None = None  # (L, H, T, k)
    top_keys: Tensor | None = None  # (L, H, T, k) int32

    @property
    def num_tokens(self) -> int:
        return self.token_sums.shape[-1]

    def token_scores(self) -> Float[Tensor, "l h t"]:
        """``(L, H, T)``: mean over queries i ≥ j of w_ij."""
        return later_query_mean(self.token_sums, self.num_tokens)

    def first_token_weight(self) -> Float[Tensor, " l"]:
        """``(L,)``: per-layer first-token weight of the normalised measure."""
        folded = torch.stack([self.first, self.row_sum - self.first], dim=-1)
        return first_token_weight(normalised(folded, self.measure))  # already folded

    def mean_entropy(self, exclude_first: bool = False) -> float:
        """Mean over layers, heads and queries of the per-query entropy (query 0 is left
        out when token 0 is)."""
        if exclude_first:
            rows = self.entropy_excl_first[..., 1:]
            return float(rows.mean()) if rows.numel() else float("nan")
        return float(self.entropy.mean())

    def tensors(self) -> dict[str, Tensor]:
        out = {f"{self.measure}.{name}": getattr(self, name) for name in FIELDS}
        if self.top_values is not None and self.top_keys is not None:
            out[f"{self.measure}.top_values"] = self.top_values
            out[f"{self.measure}.top_keys"] = self.top_keys
        return out

    @classmethod
    def from_tensors(cls, measure: str, tensors: dict[str, Tensor]) -> MeasureReductions:
        fields = {name: tensors[f"{measure}.{name}"] for name in FIELDS}
        return cls(
            measure,
            **fields,
            top_values=tensors.get(f"{measure}.top_values"),
            top_keys=tensors.get(f"{measure}.top_keys"),
        )


def follows(name: str, measures: Sequence[str]) -> str | None:
    """The measure among ``measures`` whose block ``name``'s reductions follow from (its
    :class:`~.registry.RowScaled` or :class:`~.registry.AbsoluteOf` base, computed itself),
    or None when ``name`` is reduced from its own block."""
    measure = get_measure(name)
    algebra = measure.algebra
    if not isinstance(algebra, RowScaled | AbsoluteOf) or algebra.base not in measures:
        return None
    base = get_measure(algebra.base)
    # entropies and top keys are shared only between weights (non-weights keep neither)
    if base.algebra is not None or not (base.is_weight and measure.is_weight):
        return None
    return algebra.base


class ReductionAccumulator:
    """Accumulates :class:`MeasureReductions` of several measures block by block."""

    def __init__(
        self,
        measures: list[str],
        num_layers: int,
        num_heads: int,
        num_tokens: int,
        top_k: int = DEFAULT_TOP_K,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kernels: Kernels | None = None,
    ) -> None:
        if top_k < 0:
            raise ValueError(f"top_k must be 0 or more, not {top_k}")
        shape = (num_layers, num_heads, num_tokens)
        # k slots whatever T is: the slots a query cannot fill (it sees fewer keys) are
        # key −1, value 0, as for a query early in the text
        self.top_k = top_k
        self.kernels = kernels if kernels is not None else Kernels("torch")
        self.results: dict[str, MeasureReductions] = {}
        # keys fit int16 up to 32,768 tokens (−1 marks an empty slot)
        key_dtype = torch.int16 if num_tokens <= 2**15 else torch.int32
        empty = torch.zeros((), dtype=dtype, device=device).expand(shape)
        for name in measures:
            weight = get_measure(name).is_weight
            k = self.top_k if weight else 0
            fields = {
                f: torch.zeros(shape, dtype=dtype, device=device)
                if weight or f in ("token_sums", "first", "row_sum")
                else empty  # entropies are kept for weights only
                for f in FIELDS
            }
            self.results[name] = MeasureReductions(
                name,
                **fields,
                top_values=torch.zeros(*shape, k, dtype=dtype, device=device) if k else None,
                top_keys=torch.zeros(*shape, k, dtype=key_dtype, device=device) if k else None,
            )
        # measures whose top keys are another's (vw_on: vw's, row-scaled; ihc: contribution's,
        # |·|) share that tensor instead of a copy
        self._followed_by_abs: set[str] = set()  # measures whose |·| is traced too (ihc)
        for name in measures:
            base = follows(name, measures)
            if base is not None and name in self.results:
                self.results[name].top_keys = self.results[base].top_keys
                if isinstance(get_measure(name).algebra, AbsoluteOf):
                    self._followed_by_abs.add(base)

    def add(
        self,
        name: str,
        pos: int,
        first_query: int,
        w: Float[Tensor, "h i k"],
        first_key: int = 0,
        log_terms: tuple[Tensor, Tensor, Tensor | None] | None = None,
    ) -> BlockSums | None:
        """Fold in rows ``first_query …`` of layer ``pos``; ``w`` holds keys
        ``first_key … first_key + K − 1`` (the rest are zero: outside a sliding window).

        Maps are zero where a query may not attend (later keys), so sums over all rows
        are sums over the queries i ≥ j. Returns the block's :class:`~.kernels.BlockSums`
        (sums of ``|w|`` among them) for measures derived from this one (:meth:`add_abs_of`);
        None for a measure that is not a weight (none follows from one). ``log_terms``: the
        block's logarithm without taking it (:func:`~.kernels.block_sums`).
        """
        w = w.to(self.results[name].token_sums.dtype)
        m = get_measure(name)
        if not m.is_weight:
            self.fold_other(name, pos, first_query, w.sum(-2), w.sum(-1), w[..., 0], first_key)
            return None  # no entropy, no top keys, and no measure follows from it
        k = self.top_slots(name, w.shape[-1])
        s = block_sums(
            w,
            signed=m.signed,
            maxima=k > 0 and chunked(w.shape[-1], k),
            col_abs=name in self._followed_by_abs,
            log_terms=log_terms,
        )
        top = None
        if k:
            idx = top_indices(w, k, maxima=s.maxima, signed=m.signed)
            top = idx, w.gather(-1, idx)
        self.fold(name, pos, first_query, s, top, first_key)
        return s

    def top_slots(self, name: str, num_keys: int) -> int:
        """How many top keys a block of ``num_keys`` keys gives ``name`` (0: none kept)."""
        return min(self.top_k, num_keys) if self.results[name].top_values is not None else 0

    def fold(
        self,
        name: str,
        pos: int,
        first_query: int,
        s: BlockSums,
        top: tuple[Tensor, Tensor] | None,
        first_key: int = 0,
    ) -> None:
        """Fold a weight measure's block, given as its sums ``s`` and its top keys (indices
        into the block's keys and their signed values, ``(H, I, k)`` each, or None), into
        layer ``pos``: what :meth:`add` does after summing, shared with traces that sum
        every measure in one compiled pass (:func:`~.kernels.fused_measure_sums`)."""
        r = self.results[name]
        rows = slice(first_query, first_query + s.row.shape[-1])
        keys = slice(first_key, first_key + s.col.shape[-1])
        r.token_sums[pos, :, keys] += s.col
        r.first[pos, :, rows] = s.first_value if first_key == 0 else 0
        # sums over the keys after the block's first, then that key added: subtracting token
        # 0 from the whole row instead would cancel catastrophically in rows where the sink
        # holds nearly all the weight
        total = s.rest_total + s.first
        a_log_a = s.rest_log - torch.special.entr(s.first)
        r.row_sum[pos, :, rows] = s.row if get_measure(name).signed else total
        r.entropy[pos, :, rows] = entropy_of_rows(total, a_log_a)
        r.entropy_excl_first[pos, :, rows] = (
            entropy_of_rows(s.rest_total, s.rest_log) if first_key == 0 else r.entropy[pos, :, rows]
        )
        if first_query == 0:
            r.entropy_excl_first[pos, :, 0] = 0
        if top is not None:
            idx, values = top
            self._set_top(r, pos, rows, idx + first_key, values)

    def fold_other(
        self,
        name: str,
        pos: int,
        first_query: int,
        col: Tensor,
        row: Tensor,
        first_value: Tensor,
        first_key: int = 0,
    ) -> None:
        """Fold a measure that is not a weight (its column and row sums and w_i0)."""
        r = self.results[name]
        rows = slice(first_query, first_query + row.shape[-1])
        r.token_sums[pos, :, first_key : first_key + col.shape[-1]] += col
        r.first[pos, :, rows] = first_value if first_key == 0 else 0
        r.row_sum[pos, :, rows] = row

    def _set_top(
        self, r: MeasureReductions, pos: int, rows: slice, keys: Tensor, values: Tensor
    ) -> None:
        """Store top keys; where a query has fewer than k keys of nonzero weight the rest
        are key −1, value 0 (zero-weight keys, such as later ones, are not ranked)."""
        assert r.top_values is not None and r.top_keys is not None
        query = torch.arange(rows.start, rows.stop, device=keys.device)[None, :, None]
        beyond = (keys > query) | (values == 0)
        k = keys.shape[-1]
        r.top_keys[pos, :, rows] = -1
        r.top_values[pos, :, rows] = 0
        r.top_keys[pos, :, rows, :k] = torch.where(beyond, -1, keys).to(r.top_keys.dtype)
        r.top_values[pos, :, rows, :k] = torch.where(beyond, 0, values)

    def follow(
        self, name: str, base: str, pos: int, rows: slice, values_of: Callable[[Tensor], Tensor]
    ) -> None:
        """Rows ``rows`` of ``name``'s entropies and top keys become ``base``'s, its top
        values ``values_of(base's)``: for a measure that is a row scaling or ``|·|`` of
        ``base`` (see :func:`follows`), whose sums were folded on their own."""
        self._follow(self.results[name], self.results[base], pos, rows, values_of)

    @staticmethod
    def _follow(
        r: MeasureReductions,
        b: MeasureReductions,
        pos: int,
        rows: slice,
        values_of: Callable[[Tensor], Tensor],
    ) -> None:
        """Rows ``rows`` of ``r``'s entropies and top keys are ``b``'s (a row scaling and
        ``|·|`` leave them unchanged); its top values are ``values_of(b's)``."""
        r.entropy[pos, :, rows] = b.entropy[pos, :, rows]
        r.entropy_excl_first[pos, :, rows] = b.entropy_excl_first[pos, :, rows]
        if r.top_values is not None and r.top_keys is not None and b.top_values is not None:
            assert b.top_keys is not None
            if r.top_keys is not b.top_keys:
                r.top_keys[pos, :, rows] = b.top_keys[pos, :, rows]
            r.top_values[pos, :, rows] = values_of(b.top_values[pos, :, rows])

    def add_row_scaled(
        self,
        name: str,
        base: str,
        pos: int,
        first_query: int,
        base_block: Tensor,
        scale: Float[Tensor, " i"],
        first_key: int = 0,
    ) -> None:
        """Reductions of ``name`` = ``base`` with each query row scaled by ``scale ≥ 0``
        (vw_on = vw / ‖o_i‖), from ``base``'s reductions of the same block: the entropy and
        the top keys are unchanged, the rest scales; one pass for the token sums."""
        r, b = self.results[name], self.results[base]
        rows = slice(first_query, first_query + base_block.shape[-2])
        keys = slice(first_key, first_key + base_block.shape[-1])
        s = scale.to(r.token_sums.dtype)
        r.token_sums[pos, :, keys] += s @ base_block.to(s.dtype)
        for field in ("first", "row_sum"):
            getattr(r, field)[pos, :, rows] = getattr(b, field)[pos, :, rows] * s
        self._follow(r, b, pos, rows, lambda values: values * s[:, None])

    def add_abs_of(
        self,
        name: str,
        base: str,
        pos: int,
        first_query: int,
        base_sums: BlockSums,
        first_key: int = 0,
    ) -> None:
        """Reductions of ``name`` = ``|base|`` (ihc = |ĉ|) from ``base``'s reductions and
        the sums its :meth:`add` returned: entropy and top keys are |·|'s."""
        r, b = self.results[name], self.results[base]
        rows = slice(first_query, first_query + base_sums.row.shape[-1])
        keys = slice(first_key, first_key + base_sums.col.shape[-1])
        assert base_sums.col_abs is not None  # add() sums |·| for a base that |·| follows
        r.token_sums[pos, :, keys] += base_sums.col_abs
        r.first[pos, :, rows] = b.first[pos, :, rows].abs()
        r.row_sum[pos, :, rows] = base_sums.rest_total + base_sums.first
        self._follow(r, b, pos, rows, torch.abs)

    def add_scaled_block(
        self,
        name: str,
        pos: int,
        first_query: int,
        block: Float[Tensor, "h i k"],
        query_factor: Float[Tensor, " i"] | None,
        key_factor: Float[Tensor, "h k"] | None,
        first_key: int = 0,
    ) -> None:
        """Fold a measure that is not a weight, ``query_i · block_ij · key_j`` (zero where
        the query may not attend; a factor None is 1), from matrix–vector products on the
        block: its map is never built."""
        dtype = self.results[name].token_sums.dtype
        b = block.to(dtype)
        q = None if query_factor is None else query_factor.to(dtype)
        k = None if key_factor is None else key_factor.to(dtype)
        col = b.sum(-2) if q is None else q @ b
        # (1, K) · (K, I) per head: the orientation in which the product is one fast pass
        row = b.sum(-1) if k is None else torch.bmm(k[:, None, :], b.transpose(1, 2))[:, 0]
        first = b[..., 0]
        if k is not None:
            col, first = col * k, first * k[:, :1]
        if q is not None:
            row, first = row * q, first * q
        self.fold_other(name, pos, first_query, col, row, first, first_key)

    def add_rank_one(
        self,
        name: str,
        pos: int,
        first_query: int,
        key_factor: Float[Tensor, "h k"],
        query_factor: Float[Tensor, " i"],
        valid: Bool[Tensor, "i k"],
        first_key: int = 0,
    ) -> None:
        """Reductions of a non-weight map ``key_factor_j · query_factor_i`` on the valid
        pairs (relative_norm = ‖ṽ_j‖ / ‖o_i‖) without building it: matrix–vector products."""
        r = self.results[name]
        dtype = r.token_sums.dtype
        rows = slice(first_query, first_query + valid.shape[0])
        keys = slice(first_key, first_key + valid.shape[1])
        kf, qf, v = key_factor.to(dtype), query_factor.to(dtype), valid.to(dtype)
        r.token_sums[pos, :, keys] += kf * (qf @ v)[None, :]
        r.first[pos, :, rows] = (kf[:, :1] * (qf * v[:, 0])[None, :]) if first_key == 0 else 0
        r.row_sum[pos, :, rows] = qf[None, :] * (kf @ v.T)


def chunked(num_keys: int, k: int, chunk: int = CHUNK) -> bool:
    """Whether :func:`top_indices` searches rows of ``num_keys`` keys by chunks."""
    return num_keys >= 4 * k * chunk


def top_indices(
    a: Float[Tensor, "*lead t"],
    k: int,
    chunk: int = CHUNK,
    maxima: Tensor | None = None,
    signed: bool = False,
) -> Tensor:
    """Indices of the ``k`` largest entries of each row of ``a`` (≥ 0), largest first;
    ``signed``: of ``|a|`` (the maxima, if given, are of ``|a|``), without making it.

    For long rows (:func:`chunked`), the rows are cut into chunks of ``chunk`` keys (the
    last may be shorter) and only the ``k`` chunks with the largest maxima are searched:
    every one of the k largest entries lies in one of them (a chunk outside them has k
    chunks above its maximum, each holding an entry larger than any of its own). One fast
    max pass (or none, given the chunks' ``maxima``, :func:`~.kernels.chunk_maxima`)
    replaces most of a full ``topk``.
    """
    t = a.shape[-1]
    if signed and (maxima is None or not chunked(t, k, chunk)):
        a, signed = a.abs(), False  # |a| made whole: its maxima are to come, or rows are short
    if not chunked(t, k, chunk):
        return torch.topk(a, k, dim=-1).indices
    if maxima is None:
        maxima = chunk_maxima(a, chunk)
    cols, inside = chunk_candidates(maxima, k, t, chunk)
    candidates = a.gather(-1, cols)
    if signed:
        candidates.abs_()
    candidates.masked_fill_(~inside, -1.0)  # (…, k · chunk), ≥ 0
    pick = torch.topk(candidates, k, dim=-1).indices
    return cols.gather(-1, pick)


def chunk_candidates(
    maxima: Tensor, k: int, num_keys: int, chunk: int = CHUNK
) -> tuple[Tensor, Tensor]:
    """The keys of the ``k`` chunks with the largest maxima, ``(…, k · chunk)``, and
    whether each is a key (the last chunk may be shorter; its missing keys are clamped to
    the last key and marked False)."""
    best = torch.topk(maxima, k, dim=-1).indices  # (…, k) chunk numbers
    cols = (best[..., None] * chunk + torch.arange(chunk, device=maxima.device)).flatten(-2)
    inside = cols < num_keys
    return cols.clamp_max(num_keys - 1), inside
