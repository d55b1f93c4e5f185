"""What a measure's reductions read without its block: column sums that factorise per key,
and ln w known from the scores capture kept (:attr:`~.registry.Measure.column_sums`,
:attr:`~.registry.Measure.log_terms`)."""

# ruff: noqa: F722  (jaxtyping shape strings are not forward references)

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from .layer import LayerTensors


# Σ_i w_ij over a block of queries, for measures whose sum factorises per key, so that no
# (B, H, I, T) measure tensor or masked copy is built (faithfulness ranks tokens by these).
# Each equals the masked column sum of the measure to float rounding where α is 0 outside
# the mask.
def attention_column_sums(lt: LayerTensors) -> Float[Tensor, "b h t"]:
    return lt.probs.sum(-2)  # Σ_i α_ij


def vw_column_sums(lt: LayerTensors) -> Float[Tensor, "b h t"]:
    return lt.value_norm * lt.probs.sum(-2)  # ‖ṽ_j‖ Σ_i α_ij


def vw_on_column_sums(lt: LayerTensors) -> Float[Tensor, "b h t"]:
    # ‖ṽ_j‖ Σ_i α_ij / ‖o_i‖ = ‖ṽ_j‖ · ((1/‖o‖)ᵀ α)_j
    return lt.value_norm * torch.einsum("bi,bhit->bht", lt.inv_output_norm, lt.probs)


def ihc_column_sums(lt: LayerTensors) -> Float[Tensor, "b h t"]:
    # Σ_i |α_ij ⟨o_i, ṽ_j⟩| / ‖o_i‖²: one elementwise |·| pass, then a weighted column sum
    dots = (lt.probs * lt.output_dot_values).abs_()
    return torch.einsum("bi,bhit->bht", lt.inv_output_norm2, dots)


# ln w without a logarithm, where capture kept the scores (the entropies' sums read these)
def attention_log_terms(lt: LayerTensors) -> tuple[Tensor, Tensor, None] | None:
    """ln α_ij = s_ij − lse_i (batch row 0), or None where no scores were kept."""
    g = lt.logits
    return None if g is None else (g.scores[0], g.lse[0], None)


def vw_log_terms(lt: LayerTensors) -> tuple[Tensor, Tensor, Tensor] | None:
    """ln(α_ij ‖ṽ_j‖) = s_ij − lse_i + ln ‖ṽ_j‖ (batch row 0), or None."""
    g = lt.logits
    if g is None:
        return None
    n = lt.value_norm[0]
    return g.scores[0], g.lse[0], n.clamp_min(torch.finfo(n.dtype).tiny).log()
