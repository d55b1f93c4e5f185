"""Contribution flow's routes (method §7.4): the graph of one target's heaviest flows,
layer by layer and head by head, read from the per-layer rows of a top-down pass."""

from __future__ import annotations

import torch
from torch import Tensor

from .flow_factors import FlowForward, FlowOutput, LayerFactors, probs_at, values_at


def head_rows(f: LayerFactors, row: int, stop: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Row ``row`` of layer l's mixing matrix split by head: ``(H, stop)`` shares
    A_ij^(l,h) and the residual share ρ_i (method §7.1)."""
    call = f.call
    assert call is not None and f.back is not None and f.rho is not None
    keys = slice(0, stop)
    probs = probs_at(call, slice(row, row + 1), keys, dtype)[:, 0]  # (H, K)
    dots = torch.einsum("hd,hkd->hk", f.back[row], values_at(call, keys, dtype))
    return probs * dots, f.rho[row]


def extract_routes(
    fwd: FlowForward,
    out: FlowOutput,
    target: int,
    threshold: float,
    max_nodes: int = 64,
) -> tuple[float, list[tuple[int, int, int, int, float]]]:
    """The edges of one target's flow graph above ``threshold`` × its total, top down
    (method §7.4): ``(absolute threshold, [(layer, source, target, head, weight)])`` with
    head −1 for the residual stream. At most ``max_nodes`` nodes per level are expanded
    (the heaviest)."""
    if not out.layer_rows:
        raise ValueError("routes need the per-layer rows: propagate(..., keep_rows=True)")
    dt = out.scores.dtype
    total = float(out.scores[target].abs().sum()) or 1.0
    cut = threshold * total
    num_layers = len(fwd.layers)
    stop = out.scores.shape[1]
    frontier = {int(fwd.positions[target])}
    edges: list[tuple[int, int, int, int, float]] = []
    for k, idx in enumerate(range(num_layers - 1, -1, -1)):
        before = out.layer_rows[k][target]  # over level idx + 1
        f = fwd.layers[idx]
        heaviest = sorted(frontier, key=lambda i: -abs(float(before[i])))[:max_nodes]
        reached: set[int] = set()
        for i in heaviest:
            weight_i = before[i]
            if float(weight_i.abs()) < cut:
                continue
            shares, rho = head_rows(f, i, min(stop, i + 1), dt)
            flows = weight_i * shares  # (H, i+1)
            heads, sources = torch.nonzero(flows.abs() >= cut, as_tuple=True)
            for h, j in zip(heads.tolist(), sources.tolist(), strict=True):
                edges.append((idx, j, i, h, float(flows[h, j])))
                reached.add(j)
            residual = float(weight_i * rho)
            if abs(residual) >= cut:
                edges.append((idx, i, i, -1, residual))
                reached.add(i)
        frontier = reached
        if not frontier:
            break
    return cut, edges
