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
* ``top_values`` and ``top_keys`` ``(L, H, T, k)``: the k keys with the largest weight
  per query (largest |w| for signed measures, values kept signed), in decreasing order.

Memory is O(L·H·T·k). The same reductions of a full map (``Trace.token_scores`` on a trace
with maps) go through the same code, one layer and block at a time, so the two agree to
float rounding.
"""

# ruff: noqa: F722  (jaxtyping shape strings are not forward references)

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

from .aggregates import first_token_weight, later_query_mean, later_query_sums, normalised
from .registry import get_measure

DEFAULT_TOP_K = 8
FIELDS = ("token_sums", "first", "row_sum", "entropy", "entropy_excl_first")


def row_entropy(a: Float[Tensor, "*lead t"]) -> Float[Tensor, "*lead"]:
    """Entropy of each row of ``a >= 0`` normalised to sum 1 (0 for an all-zero row)."""
    total = a.sum(-1)
    a_log_a = torch.xlogy(a, a).sum(-1)
    ok = total > 0
    safe_total = torch.where(ok, total, torch.ones_like(total))
    row = torch.where(ok, torch.log(safe_total) - a_log_a / safe_total, torch.zeros_like(total))
    return row.clamp_min(0)


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
        return first_token_weight(normalised(folded, self.measure))

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
        self.top_k = min(top_k, num_tokens)
        self.results: dict[str, MeasureReductions] = {}
        for name in measures:
            weight = get_measure(name).is_weight
            k = self.top_k if weight else 0
            zeros = {f: torch.zeros(shape, dtype=dtype, device=device) for f in FIELDS}
            self.results[name] = MeasureReductions(
                name,
                **zeros,
                top_values=torch.zeros(*shape, k, dtype=dtype, device=device) if k else None,
                top_keys=torch.zeros(*shape, k, dtype=torch.int32, device=device) if k else None,
            )

    def add(self, name: str, pos: int, first_query: int, w: Float[Tensor, "h i t"]) -> None:
        """Fold in rows ``first_query … first_query + I − 1`` of layer ``pos``."""
        r = self.results[name]
        rows = slice(first_query, first_query + w.shape[-2])
        w = w.to(r.token_sums.dtype)
        r.token_sums[pos] += later_query_sums(w, first_query)
        r.first[pos, :, rows] = w[..., 0]
        r.row_sum[pos, :, rows] = w.sum(-1)
        if not get_measure(name).is_weight:
            return
        a = w.abs()
        r.entropy[pos, :, rows] = row_entropy(a)
        r.entropy_excl_first[pos, :, rows] = row_entropy(a[..., 1:])
        if first_query == 0:
            r.entropy_excl_first[pos, :, 0] = 0
        if r.top_values is not None and r.top_keys is not None:
            signed = get_measure(name).signed
            # rank only the keys j <= i a query may see (later keys hold zeros)
            query = torch.arange(rows.start, rows.stop, device=w.device)[None, :, None]
            later = torch.arange(w.shape[-1], device=w.device)[None, None, :] > query
            rank = (a if signed else w).masked_fill(later, float("-inf"))
            _, keys = torch.topk(rank, self.top_k, dim=-1)
            values = w.gather(-1, keys)
            # a query i has i + 1 keys j <= i: the rest of its k are marked key -1, value 0
            beyond = torch.arange(self.top_k, device=w.device)[None, None, :] > query
            r.top_keys[pos, :, rows] = torch.where(beyond, -1, keys).to(torch.int32)
            r.top_values[pos, :, rows] = torch.where(beyond, 0, values)
