"""Aggregates of SPEC §3 over ``(..., H, T, T)`` weight tensors (pure maths).

The leading dimensions are free: a single layer ``(H, T, T)`` or a stack of layers
``(L, H, T, T)``; reductions over layers are left to the caller.
"""

# ruff: noqa: F722  (jaxtyping shape strings are not forward references)

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from .layer import safe_div
from .registry import get_measure


def token_scores(w: Float[Tensor, "*lead h t t"]) -> Float[Tensor, "*lead h t"]:
    """``(..., H, T)``: s_j^(h) = mean over queries i ≥ j of w_ij^(h) (paper §5.1)."""
    t = w.shape[-1]
    lower = torch.ones(t, t, dtype=torch.bool, device=w.device).tril()
    total = torch.where(lower, w, torch.zeros((), dtype=w.dtype, device=w.device)).sum(-2)
    count = torch.arange(t, 0, -1, device=w.device, dtype=w.dtype)
    return total / count


def normalised(w: Float[Tensor, "*lead h i t"], measure: str) -> Float[Tensor, "*lead h i t"]:
    """Scale a measure so that each query's weights sum to 1 over (head, key)."""
    norm = get_measure(measure).normalise
    if norm is None:
        raise ValueError(f"measure {measure!r} is not a weight and has no normalisation")
    return norm(w)


def first_token_weight(w_normalised: Float[Tensor, "*lead h i t"]) -> Float[Tensor, "*lead"]:
    """``(...,)``: E[w_0] = (1/T) Σ_i Σ_h w_i0 for normalised weights ``(..., H, T, T)``."""
    return w_normalised[..., 0].sum(dim=-2).mean(dim=-1)


def entropy(
    w: Float[Tensor, "*lead h i t"], exclude_first: bool = False
) -> Float[Tensor, "*lead h"]:
    """``(..., H)``: per head, mean over queries of −Σ_j c̄_ij log c̄_ij, c̄ = |w|/Σ_k|w|.

    With ``exclude_first`` token 0 is dropped as a key (weights renormalised over j ≥ 1)
    and query 0, which then has no key, is dropped too.
    """
    a = w.abs()
    if exclude_first:
        a = a[..., 1:, 1:]
    p = safe_div(a, a.sum(-1, keepdim=True))
    plogp = torch.where(p > 0, p * torch.log(torch.where(p > 0, p, torch.ones_like(p))), 0.0)
    return (-plogp.sum(-1)).mean(-1)
