"""The distance-based measure of Ferrando et al. (2022), the one measure that needs every
``α_ij ṽ_j^(h)`` explicitly (``T² · d`` numbers per head and layer), so it is not part of
``"all"`` and is computed only when named."""

from __future__ import annotations

import math

import torch

from .layer import LayerTensors, Weights, safe_div


def distance(lt: LayerTensors, max_elements: int = 1 << 25) -> Weights:
    """Ferrando et al. (2022): max(0, ‖o_i‖₁ − ‖o_i − α_ij ṽ_j^(h)‖₁), normalised per query.

    Needs every ``α_ij ṽ_j^(h)`` explicitly; they are built for blocks of (query, head)
    pairs and key ranges holding at most ``max_elements`` numbers at a time (at least one
    key's ``B × d``), besides the ``(B, H, T, d)`` projected values themselves.
    """
    b, h, i, t = lt.probs.shape
    d = lt.w_o.shape[1]
    projected = lt.projected_values
    out = lt.output
    out_l1 = out.abs().sum(-1)  # (B, I)
    # a query whose every D is below the rounding error of the L1 sums gets no weights:
    # such D are noise (say W_O = 0), and normalising them would invent weights of 1/H
    noise = out_l1 * (4 * math.sqrt(d) * torch.finfo(out.dtype).eps)  # (B, I)
    result = torch.empty_like(lt.probs)
    keys = max(1, min(t, max_elements // max(1, b * d)))  # keys per block, one query and head
    queries = max(1, min(i, max_elements // max(1, b * h * keys * d)))
    heads = max(1, min(h, max_elements // max(1, b * queries * keys * d)))
    for q0 in range(0, i, queries):
        q1 = min(i, q0 + queries)
        o_block = out[:, None, q0:q1, None, :]
        for h0 in range(0, h, heads):
            h1 = min(h, h0 + heads)
            for k0 in range(0, t, keys):
                k1 = min(t, k0 + keys)
                alpha = lt.probs[:, h0:h1, q0:q1, k0:k1, None]
                weighted = alpha * projected[:, h0:h1, None, k0:k1]  # (B, h, q, k, d)
                rest = (o_block - weighted).abs().sum(-1)
                gain = out_l1[:, None, q0:q1, None] - rest
                result[:, h0:h1, q0:q1, k0:k1] = gain.clamp_min(0)
    result = lt.masked_(result)
    only_noise = result.amax(dim=(1, 3)) <= noise  # (B, I)
    result = result.masked_fill_(only_noise[:, None, :, None], 0.0)
    total = result.sum(dim=(1, 3), keepdim=True)
    return safe_div(result, total)
