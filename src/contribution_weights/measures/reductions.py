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
    sum_a_log_a,
)
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
    ) -> None:
        if top_k < 0:
            raise ValueError(f"top_k must be 0 or more, not {top_k}")
        shape = (num_layers, num_heads, num_tokens)
        # k slots whatever T is: the slots a query cannot fill (it sees fewer keys) are
        # key −1, value 0, as for a query early in the text
        self.top_k = top_k
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
        for name in measures:
            base = follows(name, measures)
            if base is not None and name in self.results:
                self.results[name].top_keys = self.results[base].top_keys

    def add(
        self,
        name: str,
        pos: int,
        first_query: int,
        w: Float[Tensor, "h i k"],
        first_key: int = 0,
    ) -> Tensor:
        """Fold in rows ``first_query …`` of layer ``pos``; ``w`` holds keys
        ``first_key … first_key + K − 1`` (the rest are zero: outside a sliding window).

        Maps are zero where a query may not attend (later keys), so sums over all rows
        are sums over the queries i ≥ j. Returns ``|w|`` (or ``w`` for non-negative
        measures) for shortcuts of measures derived from this one.
        """
        r = self.results[name]
        rows = slice(first_query, first_query + w.shape[-2])
        keys = slice(first_key, first_key + w.shape[-1])
        w = w.to(r.token_sums.dtype)
        r.token_sums[pos, :, keys] += w.sum(-2)
        r.first[pos, :, rows] = w[..., 0] if first_key == 0 else 0
        m = get_measure(name)
        a = w.abs() if m.signed else w
        if not m.is_weight:
            r.row_sum[pos, :, rows] = w.sum(-1)
            return a
        # sums over the keys after token 0 first, then token 0 added: subtracting it from
        # the whole row instead would cancel catastrophically in rows where the sink holds
        # nearly all the weight
        rest = a[..., 1:] if first_key == 0 else a
        rest_total, rest_log = rest.sum(-1), sum_a_log_a(rest)
        if first_key == 0:
            a0 = a[..., 0]
            total, a_log_a = rest_total + a0, rest_log - torch.special.entr(a0)
            excl = entropy_of_rows(rest_total, rest_log)
        else:
            total, a_log_a = rest_total, rest_log
        r.row_sum[pos, :, rows] = total if not m.signed else w.sum(-1)
        r.entropy[pos, :, rows] = entropy_of_rows(total, a_log_a)
        if first_key != 0:
            excl = r.entropy[pos, :, rows]
        r.entropy_excl_first[pos, :, rows] = excl
        if first_query == 0:
            r.entropy_excl_first[pos, :, 0] = 0
        if r.top_values is not None and r.top_keys is not None:
            k = min(self.top_k, w.shape[-1])
            idx = top_indices(a, k)
            self._set_top(r, pos, rows, idx + first_key, w.gather(-1, idx))
        return a

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
        r.token_sums[pos, :, keys] += torch.einsum("hik,i->hk", base_block.to(s.dtype), s)
        for field in ("first", "row_sum"):
            getattr(r, field)[pos, :, rows] = getattr(b, field)[pos, :, rows] * s
        self._follow(r, b, pos, rows, lambda values: values * s[:, None])

    def add_abs_of(
        self,
        name: str,
        base: str,
        pos: int,
        first_query: int,
        abs_block: Tensor,
        first_key: int = 0,
    ) -> None:
        """Reductions of ``name`` = ``|base|`` (ihc = |ĉ|) from ``base``'s reductions and
        the ``|base|`` block its :meth:`add` returned: entropy and top keys are |·|'s."""
        r, b = self.results[name], self.results[base]
        rows = slice(first_query, first_query + abs_block.shape[-2])
        keys = slice(first_key, first_key + abs_block.shape[-1])
        r.token_sums[pos, :, keys] += abs_block.sum(-2)
        r.first[pos, :, rows] = b.first[pos, :, rows].abs()
        r.row_sum[pos, :, rows] = abs_block.sum(-1)
        self._follow(r, b, pos, rows, torch.abs)

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


def top_indices(a: Float[Tensor, "*lead t"], k: int, chunk: int = 32) -> Tensor:
    """Indices of the ``k`` largest entries of each row of ``a``, largest first.

    For long rows, the rows are cut into chunks of ``chunk`` keys and only the ``k`` chunks
    with the largest maxima are searched: every one of the k largest entries lies in one
    of them (a chunk outside them has k chunks above its maximum, each holding an entry
    larger than any of its own). One fast max pass replaces most of a full ``topk``.
    """
    t = a.shape[-1]
    if t < 4 * k * chunk or t % chunk:
        return torch.topk(a, k, dim=-1).indices
    lead = a.shape[:-1]
    blocks = a.reshape(*lead, t // chunk, chunk)
    best = torch.topk(blocks.amax(-1), k, dim=-1).indices  # (…, k) chunk numbers
    cols = (best[..., None] * chunk + torch.arange(chunk, device=a.device)).flatten(-2)
    candidates = a.gather(-1, cols)  # (…, k · chunk)
    pick = torch.topk(candidates, k, dim=-1).indices
    return cols.gather(-1, pick)
