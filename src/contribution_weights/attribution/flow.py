"""Contribution flow (method §7): which input tokens drove a prediction, from one forward.

One forward pass runs every attention layer on the model's own sdpa kernel and keeps, per
layer, what the top-down pass needs: the layer's call (queries, keys, values, mask: the
attention probabilities are recomputed block by block, exactly as eager computes them),
the factor ``b_i^(h) = W_O^(h)ᵀ (s_i ⊙ y_i) / ‖y_i‖²`` and the residual share ``ρ_i``, and
at each target position the few vectors the logit projection reads. Then a row vector per
target is carried from the top layer down (``r ← r A^l + g^l``); no ``T × T`` matrix and
no ``(H, T, T, d)`` tensor is ever built, and only the queries up to the last target are
visited.

The same pass composes other per-layer mixing rules (:class:`Rule`): the projection shares
of method §7.1 (``flow``), attention rollout and an ALTI-style rollout on L1 distances.
With ``rule="direct"`` nothing is composed (method §7.6): each layer's update at the target
is credited to the positions it read, and a position's state is not decomposed further.

The forward and the factors it records live in :mod:`.flow_factors`, the routes graph
(:func:`extract_routes`) in :mod:`.flow_routes`; both are re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import torch
from torch import Tensor

from ..capture import LayerCall, rows_per_block
from ..loading import LoadedModel
from ..measures.layer import reciprocal
from .flow_factors import (
    FlowForward,
    FlowOutput,
    LayerFactors,
    Linearised,
    first_tensor,
    forward_factors,
    linearise_norm,
    probs_at,
    values_at,
)
from .flow_routes import extract_routes, head_rows
from .targets import Target, target_values

__all__ = [
    "PROPAGATION_RULES",
    "RULES",
    "FlowForward",
    "FlowOutput",
    "LayerFactors",
    "Linearised",
    "Rule",
    "end_to_end_scores",
    "extract_routes",
    "first_tensor",
    "forward_factors",
    "head_rows",
    "layer_breakdown",
    "linearise_norm",
    "mix",
    "propagate",
    "readout_directions",
    "target_step",
    "token_flow_scores",
]

Rule = Literal["flow", "rollout", "alti"]
RULES: tuple[str, ...] = ("flow", "rollout", "alti")
#: propagate's rules: the mixing rules, and ``direct`` (no mixing: every update at the
#: target credited to the positions it read, one hop; projected targets only)
PROPAGATION_RULES: tuple[str, ...] = (*RULES, "direct")


def readout_directions(
    model: LoadedModel, fwd: FlowForward, targets: Sequence[Target]
) -> tuple[Tensor, Tensor]:
    """``(n, d)`` directions w with target ≈ ⟨w, x_p^L⟩ + c, and the constants ``(n,)``
    (method §7.3). Rows of ``flow`` targets are zero."""
    unembed = model.model.get_output_embeddings()
    u = unembed.weight.detach()
    dt = fwd.final_x.dtype
    n, d = fwd.final_x.shape
    w_tilde = torch.zeros(n, d, dtype=dt, device=u.device)
    const = torch.zeros(n, dtype=dt, device=u.device)
    lm_bias = getattr(unembed, "bias", None)
    for k, t in enumerate(targets):
        if not t.projected:
            continue
        assert t.token is not None
        scale = None if fwd.capped is None else fwd.capped[k]
        coef = torch.zeros(u.shape[0], dtype=dt, device=u.device)
        if t.quantity == "logit":
            coef[t.token] = 1.0
        elif t.quantity == "contrast":
            assert t.foil is not None
            coef[t.token] += 1.0
            coef[t.foil] -= 1.0
        else:  # logprob: z_t − Σ_v P_v z_v
            coef = -torch.softmax(fwd.logits[k], -1)
            coef[t.token] += 1.0
        if scale is not None:
            coef = coef * scale
        w_tilde[k] = coef @ u.to(dt)
        if lm_bias is not None:
            const[k] += coef @ lm_bias.detach().to(dt)
    lin = fwd.final_norm
    w = lin.scale * w_tilde
    if lin.bias is not None:
        const += (w_tilde * lin.bias).sum(-1)
    if lin.centred:
        w = w - w.mean(-1, keepdim=True)
    return w, const


def _blocks(call: LayerCall, stop: int, block_bytes: int) -> Iterator[slice]:
    step = rows_per_block(call.num_heads, stop, block_bytes)
    for start in range(0, stop, step):
        yield slice(start, min(stop, start + step))


def mix(rule: str, f: LayerFactors, r: Tensor, block_bytes: int) -> Tensor:
    """``r A^l`` for rows ``r`` ``(n, T')`` over positions ``0 … T'−1`` (method §7.2, 7.5)."""
    call = f.call
    assert call is not None
    dt = r.dtype
    stop = r.shape[1]
    if rule == "flow":
        assert f.back is not None and f.rho is not None
        out = r * f.rho[:stop]
        for rows in _blocks(call, stop, block_bytes):
            weights = r[:, rows]
            if not bool(weights.any()):
                continue
            keys = slice(0, rows.stop)
            probs = probs_at(call, rows, keys, dt)  # (H, I, K)
            carried = weights[:, :, None, None] * f.back[rows][None]  # (n, I, H, d_h)
            z = torch.einsum("hik,nihd->nhkd", probs, carried)
            out[:, keys] += torch.einsum("nhkd,hkd->nk", z, values_at(call, keys, dt))
        return out
    if rule == "rollout":
        out = 0.5 * r
        for rows in _blocks(call, stop, block_bytes):
            weights = r[:, rows]
            if not bool(weights.any()):
                continue
            keys = slice(0, rows.stop)
            mean = probs_at(call, rows, keys, dt).mean(0)  # (I, K)
            out[:, keys] += 0.5 * weights @ mean
        return out
    if rule == "alti":
        return _alti_mix(f, r, block_bytes)
    raise ValueError(f"unknown mixing rule {rule!r}; choose one of {', '.join(RULES)}")


def _alti_mix(f: LayerFactors, r: Tensor, block_bytes: int) -> Tensor:
    """ALTI-style rows: c_ij = max(0, ‖y_i‖₁ − ‖y_i − T_ij‖₁), normalised (method §7.5)."""
    call = f.call
    assert call is not None and f.x is not None and f.y is not None and f.w_o is not None
    dt = r.dtype
    stop = r.shape[1]
    out = torch.zeros_like(r)
    d = f.y.shape[-1]
    step = max(1, block_bytes // max(1, stop * d * 8))
    values = values_at(call, slice(0, stop), dt)  # (H, T', d_h)
    projected = torch.einsum("hkd,hed->hke", values, f.w_o)  # (H, T', d)
    for start in range(0, stop, step):
        rows = slice(start, min(stop, start + step))
        weights = r[:, rows]
        if not bool(weights.any()):
            continue
        keys = slice(0, rows.stop)
        probs = probs_at(call, rows, keys, dt)  # (H, I, K)
        terms = torch.einsum("hik,hke->ike", probs, projected[:, keys])  # (I, K, d)
        if f.s is not None:
            terms = terms * f.s[rows][:, None]
        idx = torch.arange(rows.start, rows.stop, device=terms.device)
        terms[idx - rows.start, idx] += f.x[rows]
        y = f.y[rows][:, None]  # (I, 1, d)
        contrib = (y.abs().sum(-1) - (y - terms).abs().sum(-1)).clamp_min(0)  # (I, K)
        contrib = contrib * reciprocal(contrib.sum(-1, keepdim=True))
        out[:, keys] += weights @ contrib
    return out


def target_step(
    f: LayerFactors,
    fwd: FlowForward,
    w: Tensor,
    stop: int,
    dtype: torch.dtype,
    part: str = "both",
) -> Tensor:
    """``g^l`` of method §7.3 for every target: D^l + μ^l · (row p of A^l); ``part``
    ``"attention"`` or ``"feed_forward"`` gives one of the two terms alone."""
    call = f.call
    assert call is not None and f.back is not None and f.rho is not None and f.w_o is not None
    assert f.m_rows is not None
    n = w.shape[0]
    positions = fwd.positions
    lo, hi = int(positions.min()), int(positions.max()) + 1
    keys = slice(0, stop)
    probs = probs_at(call, slice(lo, hi), keys, dtype)  # (H, R, K)
    p_rows = probs[:, positions - lo].transpose(0, 1)  # (n, H, K)
    direct = w if f.s_rows is None else w * f.s_rows
    mu = (w * f.m_rows).sum(-1)  # (n,)
    if part == "feed_forward":
        direct = torch.zeros_like(direct)
    if part == "attention":
        mu = torch.zeros_like(mu)
    coef = torch.einsum("nd,hde->nhe", direct, f.w_o)
    if not fwd.parallel:  # the feed-forward block read y_p: μ is shared like y_p
        coef = coef + mu[:, None, None] * f.back[positions]
    cv = torch.einsum("nhe,hke->nhk", coef, values_at(call, keys, dtype))
    g = (p_rows * cv).sum(1)  # (n, K)
    # parallel residual (GPT-NeoX): the block read x_p^l, so μ goes to position p itself
    g[torch.arange(n), positions] += mu if fwd.parallel else mu * f.rho[positions]
    return g


def propagate(
    model: LoadedModel,
    fwd: FlowForward,
    targets: Sequence[Target],
    rule: str = "flow",
    keep_rows: bool = False,
    progress: Callable[[int], None] | None = None,
) -> FlowOutput:
    """The top-down pass: every target's attribution over the input tokens."""
    dt = fwd.final_x.dtype
    n = len(targets)
    stop = int(fwd.positions.max()) + 1
    device = fwd.final_x.device
    values = target_values(fwd.logits, targets)
    projected = torch.tensor([t.projected for t in targets], device=device)
    if rule not in PROPAGATION_RULES:
        raise ValueError(f"unknown rule {rule!r}; choose one of {', '.join(PROPAGATION_RULES)}")
    if bool(projected.any()) and rule not in ("flow", "direct"):
        raise ValueError(
            f"the {rule} rule is a pure flow: it has no projection on a target; "
            "use quantity='flow' with it"
        )
    if rule == "direct" and not bool(projected.all()):
        raise ValueError(
            "the direct rule credits the updates of a projected target (logprob, logit, "
            "contrast); a pure flow target has none"
        )
    w, const = readout_directions(model, fwd, targets)
    rows = torch.arange(n, device=device)
    r = torch.zeros(n, stop, dtype=dt, device=device)
    # pure-flow targets start from their position; projected ones accumulate g^l
    r[rows[~projected], fwd.positions[~projected]] = 1.0
    layer_rows = []
    for idx in range(len(fwd.layers) - 1, -1, -1):
        f = fwd.layers[idx]
        if keep_rows:
            layer_rows.append(r.clone())
        if rule != "direct":
            r = mix(rule, f, r, fwd.block_bytes)
        if bool(projected.any()):
            r = r + target_step(f, fwd, w, stop, dt) * projected[:, None].to(dt)
        if progress is not None:
            progress(1)
    embed = (w * fwd.x0_rows).sum(-1)
    r[rows, fwd.positions] += embed * projected.to(dt)
    explained = (w * fwd.final_x).sum(-1) + const
    whole = torch.where(projected, explained, torch.ones_like(explained))
    # what no token receives: biases (and the norm's constant); 0 in bias-free families
    remainder = whole - r.sum(-1)
    explained = torch.where(projected, explained, torch.full_like(explained, float("nan")))
    if keep_rows:
        layer_rows.append(r.clone())
    return FlowOutput(
        scores=r,
        targets=list(targets),
        values=values,
        explained=explained,
        remainder=remainder,
        layer_rows=layer_rows,
    )


def layer_breakdown(
    model: LoadedModel, fwd: FlowForward, targets: Sequence[Target], k: int
) -> Tensor:
    """Target ``k``'s flow attribution split by where its terms come from: ``(2L + 1, T')``,
    row l the direct effect of layer l's attention update (D^l of method §7.3), row L + l
    that of its feed-forward update (μ^l), each carried down to the input tokens; row 2L
    the embedding's own term. The rows sum to the attribution. 2L times the cost of one
    target: an analysis tool."""
    target = targets[k]
    if not target.projected:
        raise ValueError("a layer breakdown needs a projected target (logprob, logit, contrast)")
    dt = fwd.final_x.dtype
    stop = int(fwd.positions.max()) + 1
    num_layers = len(fwd.layers)
    w, _ = readout_directions(model, fwd, targets)
    # slots by origin, filled top down: slot 2·(L−1−l) and the next hold layer l's terms
    r = torch.zeros(2 * num_layers, stop, dtype=dt, device=fwd.final_x.device)
    for step, idx in enumerate(range(num_layers - 1, -1, -1)):
        f = fwd.layers[idx]
        if step:
            r[: 2 * step] = mix("flow", f, r[: 2 * step], fwd.block_bytes)
        r[2 * step] = target_step(f, fwd, w, stop, dt, "attention")[k]
        r[2 * step + 1] = target_step(f, fwd, w, stop, dt, "feed_forward")[k]
    by_origin = r.view(num_layers, 2, stop).flip(0)  # layer 0 first
    p = int(fwd.positions[k])
    embed = torch.zeros(1, stop, dtype=dt, device=r.device)
    embed[0, p] = (w[k] * fwd.x0_rows[k]).sum()
    return torch.cat([by_origin[:, 0], by_origin[:, 1], embed])


def token_flow_scores(
    model: LoadedModel,
    ids: Tensor,
    rules: Sequence[str] = ("flow",),
    *,
    limit: int | None = None,
    dtype: torch.dtype = torch.float32,
    block_bytes: int = 32 * 1024**2,
) -> dict[str, Tensor]:
    """Per rule, ``(T,)`` end-to-end token scores for a whole text, from one forward:
    ``s_j = Σ_{j ≤ i < limit} R_ij / (limit − j)``, the mean over the queries i ≥ j (as the
    measures' token scores average, method §4) of the pure flow R_ij of token j into
    position i's final state (``quantity="flow"`` at every position). R is never built:
    ``Σ_i R_ij`` is one row vector ``1_{[0, limit)}`` carried from the top layer down
    (``u ← u A^l``), so every rule costs one single-target pass. Positions ``≥ limit`` (a
    downstream item's options) score 0."""
    for rule in rules:
        if rule not in RULES:
            raise ValueError(f"unknown mixing rule {rule!r}; choose one of {', '.join(RULES)}")
    t = int(ids.shape[-1])
    stop = t if limit is None else max(1, min(t, int(limit)))
    target = [Target(position=stop - 1, quantity="flow")]
    fwd, _ = forward_factors(
        model, ids[..., :stop], target, dtype=dtype, keep_states="alti" in rules,
        block_bytes=block_bytes,
    )  # fmt: skip
    device = fwd.final_x.device
    counts = torch.arange(stop, 0, -1, dtype=dtype, device=device)  # limit − j
    out = {}
    for rule in dict.fromkeys(rules):
        u = torch.ones(1, stop, dtype=dtype, device=device)
        for f in reversed(fwd.layers):
            u = mix(rule, f, u, block_bytes)
        scores = torch.zeros(t, dtype=dtype, device=device)
        scores[:stop] = u[0] / counts
        out[rule] = scores
    return out


def end_to_end_scores(
    model: LoadedModel,
    ids: Tensor,
    names: Sequence[str | None],
    eligible_len: int | None = None,
) -> dict[str, Tensor]:
    """What a removal sweep's end-to-end rankings among ``names`` (``flow``, ``rollout``,
    ``alti``; other names are skipped) rank by: each ``(T,)`` token scores of the clean
    text ``ids`` ``(T,)`` over its scoring queries ``i < eligible_len``
    (:func:`token_flow_scores`, one forward for all of them); ``{}`` when there are none."""
    rules = [n for n in dict.fromkeys(names) if n in RULES]
    if not rules:
        return {}
    return token_flow_scores(model, ids.to(model.device), rules, limit=eligible_len)
