"""kvpress's ExpectedAttentionPress: the attention that queries drawn from the window's
query mean and covariance would pay, times ‖v_j‖; 4 sinks kept."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from .base import N_SINK, Method
from .stats import LayerStats, Scores


@dataclass(frozen=True)
class ExpectedAttention(Method):
    """kvpress's ExpectedAttentionPress (Devoto et al. 2025), from the window's queries.

    Future queries of head h are taken as Gaussian with the mean μ and covariance Σ of the
    last ``window`` queries as the attention saw them (after RoPE); the expected logit
    exponent of key j is ``s μ·k_j + s²/2 k_jᵀ Σ k_j`` (``s`` the attention scale), its
    softmax over the keys after the first ``sinks`` is the expected attention, averaged
    over the group, times ``‖v_j‖₂`` (plus ``epsilon``); the first ``sinks`` tokens are
    always kept. kvpress instead takes μ, Σ of every prefill query before RoPE, turned by
    the mean RoPE rotation of the next 512 positions.
    """

    window: int | None = None
    sinks: int = N_SINK
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    needs = ("window_queries",)

    def score(self, stats: LayerStats) -> Scores:
        queries = stats.queries_of_window(self.window)
        dtype = torch.promote_types(queries.dtype, torch.float32)
        q = queries.to(dtype)
        sinks = min(self.sinks, stats.length - 1)
        rep = q.shape[1] // stats.num_kv_heads
        keys = stats.keys[:, :, sinks:].to(dtype).repeat_interleave(rep, dim=1)
        mean = q.mean(dim=2)
        logits = stats.scaling * torch.einsum("bhd,bhtd->bht", mean, keys)
        if self.use_covariance:
            centred = q - mean[:, :, None]
            cov = centred.transpose(-1, -2) @ centred / q.shape[2]
            quad = torch.einsum("bhtd,bhde,bhte->bht", keys, cov, keys)
            logits = logits + stats.scaling**2 / 2 * quad
        scores = stats.per_kv_head(torch.softmax(logits, dim=-1))
        if self.use_vnorm:
            values = stats.values[:, :, sinks:].to(dtype)
            scores = (scores + self.epsilon) * torch.linalg.vector_norm(values, dim=-1)
        return F.pad(scores, (sinks, 0), value=float(scores.max()) + 1)
