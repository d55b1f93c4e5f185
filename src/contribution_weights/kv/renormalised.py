"""The exact change of a head's output when one cache entry is evicted, as pure maths.

Evicting key ``j`` takes it out of the softmax: every other weight of query ``i`` is divided
by ``1 − α_ij``, so the head's projected output ``o_i = Σ_k α_ik ṽ_k`` becomes
``(o_i − α_ij ṽ_j) / (1 − α_ij)`` and changes by

    Δo_ij = α_ij (o_i − ṽ_j) / (1 − α_ij),

exactly (not to first order). Contribution (method §2) measures the first-order change
without renormalisation, ``−α_ij ṽ_j`` projected on ``o_i``; the exact change points along
``o_i − ṽ_j`` and grows as ``1 / (1 − α_ij)``: a key holding most of the attention moves
the output a lot when it goes, even with a small value. docs/kv-cache.md ("The
renormalised effect") has the derivation and the score :class:`~.methods.Renormalised`
builds from it.

:func:`renormalised_effect` returns ``‖Δo_ij‖`` for every (query, key, head) without the
``(…, w, T, D)`` tensor of differences: ``‖o_i − ṽ_j‖² = ‖o_i‖² − 2 o_i·ṽ_j + ‖ṽ_j‖²``
costs one ``(w, D)·(D, T)`` product per head, and with a Gram matrix ``W_O^(h)ᵀ W_O^(h)``
it runs on the ``d_h``-sized values and head states instead of the projected ones.
"""

# ruff: noqa: F722  (jaxtyping shape strings are not forward references)

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

#: saturation threshold, in machine epsilons of the compute dtype (see
#: :func:`renormalised_effect`)
SATURATION_EPS = 16


def renormalised_effect(
    probs: Float[Tensor, "b h w t"],
    values: Float[Tensor, "b h t d"],
    outputs: Float[Tensor, "b h w d"],
    gram: Float[Tensor, "h d d"] | None = None,
    tol: float | None = None,
) -> Float[Tensor, "b h w t"]:
    """``‖Δo_ij^(h)‖``: how far evicting key ``j`` moves head ``h``'s output for query ``i``.

    Args:
        probs: α of the queries, per query head (rows summing to 1 over the keys they see;
            0 on masked keys, whose effect is then 0).
        values: ṽ_j^(h) per query head (GQA expanded), or, with ``gram``, the unprojected
            v_j^(g(h)).
        outputs: o_i^(h) = Σ_k α_ik ṽ_k^(h), or, with ``gram``, z_i^(h) = Σ_k α_ik v_k.
        gram: ``W_O^(h)ᵀ W_O^(h)``: inner products are then taken in that metric, so
            ``⟨z, v⟩_G = ⟨W_O z, W_O v⟩`` and the result equals that of the projected
            tensors, at ``d_h`` instead of ``d`` per vector.
        tol: saturation threshold on ``1 − α_ij`` (default ``16 ε`` of the compute dtype).

    Precision. The expansion ``‖o_i‖² − 2 o_i·ṽ_j + ‖ṽ_j‖²`` (clamped at 0) cancels where
    ``o_i ≈ ṽ_j``, which is the case ``α_ij → 1`` where ``1 / (1 − α_ij)`` amplifies the
    error most. Only a row's most attended key can hold more than half of the attention,
    so for it (``argmax_k α_ik``) ``o_i − ṽ_j`` is formed directly, a ``(w, D)`` difference,
    and squared: its error stays at the rounding of ``o_i``. For the other keys
    ``α_ij ≤ 1/2``, the factor is at most 2, and the expansion is used.

    Saturated keys. Where ``1 − α_ij ≤ tol``, the key holds all of the query's attention to
    working precision: the weights the others would get after renormalising rounded to 0
    (or there are no others: a query's only visible key, whose eviction leaves the head
    nothing to attend to, so the limit does not exist). The exact change, whose limit is
    ``α_ij (ō − ṽ_j)`` with ``ō`` the other keys' renormalised mean, is then not
    determined by α, and its upper bound is used instead:
    ``α_ij (‖ṽ_j‖ + max_k ‖ṽ_k‖)`` (``ō`` is a convex combination of the other values; the
    max runs over every key of the row). Such a key is never scored below what its
    eviction can do. Every entry is finite.
    """
    dtype = probs.dtype
    tol = SATURATION_EPS * torch.finfo(dtype).eps if tol is None else tol

    def metric(x: Tensor) -> Tensor:  # G x: the metric applied (identity without a Gram)
        return x if gram is None else x @ gram

    out_g = metric(outputs)  # (B, H, w, D)
    out2 = (out_g * outputs).sum(-1).clamp_min(0)  # ‖o_i‖²
    val2 = (metric(values) * values).sum(-1).clamp_min(0)  # ‖ṽ_j‖²
    dots = out_g @ values.transpose(-1, -2)  # o_i·ṽ_j, (B, H, w, T)
    dist2 = (out2[..., None] - 2 * dots + val2[..., None, :]).clamp_min(0)
    # the row's most attended key: o_i − ṽ_j directly, free of the expansion's cancellation
    top = probs.argmax(-1, keepdim=True)  # (B, H, w, 1)
    top_values = values.gather(2, top.expand(-1, -1, -1, values.shape[-1]))
    diff = outputs - top_values
    dist2 = dist2.scatter(-1, top, (metric(diff) * diff).sum(-1, keepdim=True).clamp_min(0))
    rest = 1 - probs
    saturated = rest <= tol
    effect = probs * dist2.sqrt() / torch.where(saturated, torch.ones_like(rest), rest)
    val = val2.sqrt()
    bound = probs * (val[..., None, :] + val.amax(-1)[..., None, None])
    return torch.where(saturated, bound, effect)
