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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ..capture import LayerBlock, LayerCall, capturing, check_all_layers_seen, rows_per_block
from ..families import UnsupportedModelError
from ..loading import LoadedModel
from ..measures.layer import reciprocal, split_output_weight
from .targets import Target, resolve, target_values

Rule = Literal["flow", "rollout", "alti"]
RULES: tuple[str, ...] = ("flow", "rollout", "alti")
#: propagate's rules: the mixing rules, and ``direct`` (no mixing: every update at the
#: target credited to the positions it read, one hop; projected targets only)
PROPAGATION_RULES: tuple[str, ...] = (*RULES, "direct")


@dataclass
class Linearised:
    """A norm evaluated at its input ``x``: ``n(x) = scale ⊙ (C x) + bias`` with ``C``
    the centring (LayerNorm) or the identity (RMSNorm), the scale held fixed."""

    scale: Tensor  # (..., d)
    centred: bool
    bias: Tensor | None


def linearise_norm(module: nn.Module, x: Tensor, out: Tensor, dtype: torch.dtype) -> Linearised:
    """The norm ``module`` at input ``x`` (whose output was ``out``) as a fixed per-position
    scale (method §7.1). Checked against ``out``: a norm of another kind is refused."""
    xf = x.to(dtype)
    if isinstance(module, nn.LayerNorm):
        eps = float(module.eps)
        centred = xf - xf.mean(-1, keepdim=True)
        sigma = (centred.square().mean(-1, keepdim=True) + eps).sqrt()
        weight = (
            torch.ones(xf.shape[-1], dtype=dtype, device=xf.device)
            if module.weight is None
            else module.weight.detach().to(dtype)
        )
        bias = None if module.bias is None else module.bias.detach().to(dtype)
        lin = Linearised(weight / sigma, True, bias)
        approx = lin.scale * centred + (0 if bias is None else bias)
    else:
        eps_attr = getattr(module, "eps", getattr(module, "variance_epsilon", None))
        if eps_attr is None:
            raise UnsupportedModelError(
                f"{type(module).__name__} is neither a LayerNorm nor an RMSNorm with an eps "
                "attribute; contribution flow cannot linearise it"
            )
        eps = float(eps_attr)
        param = next(module.parameters(), None)
        ref_dtype = param.dtype if param is not None else out.dtype
        with torch.no_grad():
            ones = torch.ones(1, xf.shape[-1], dtype=ref_dtype, device=xf.device)
            gain = module(ones)[0].to(dtype) * math.sqrt(1.0 + eps)
        rms = (xf.square().mean(-1, keepdim=True) + eps).sqrt()
        lin = Linearised(gain / rms, False, None)
        approx = lin.scale * xf
    err = (approx - out.to(dtype)).norm() / out.to(dtype).norm().clamp_min(1e-30)
    tolerance = 1e-3 if out.dtype in (torch.float32, torch.float64) else 3e-2
    if float(err) > tolerance:
        raise UnsupportedModelError(
            f"{type(module).__name__} does not behave as a LayerNorm or RMSNorm (relative error "
            f"{float(err):.2g} of its linearisation); contribution flow needs one of those"
        )
    return lin


@dataclass
class LayerFactors:
    """What the top-down pass reads for one layer (method §7.2)."""

    call: LayerCall | None = None
    back: Tensor | None = None  # (T, H, d_h): W_O^(h)ᵀ (s_i ⊙ y_i) / ‖y_i‖²
    rho: Tensor | None = None  # (T,): residual share π_i(x_i)
    beta: Tensor | None = None  # (T,): bias share π_i(s_i ⊙ b_O), or None
    w_o: Tensor | None = None  # (H, d, d_h)
    b_o: Tensor | None = None  # (d,)
    # at the target positions (n rows)
    y_rows: Tensor | None = None  # (n, d)
    m_rows: Tensor | None = None  # (n, d): the feed-forward update x^(l+1) − y
    s_rows: Tensor | None = None  # (n, d) post-attention norm scale, or None
    # kept for the ALTI rule only (T, d)
    x: Tensor | None = None
    y: Tensor | None = None
    s: Tensor | None = None


@dataclass
class FlowForward:
    """One forward pass's factors for the top-down pass."""

    layers: list[LayerFactors]
    positions: Tensor  # (n,) target positions
    x0_rows: Tensor  # (n, d): the embeddings at the target positions
    final_x: Tensor  # (n, d): x^L at the target positions
    final_norm: Linearised  # at the target positions
    logits: Tensor  # (n, V): the model's logits at the target positions (soft-capped)
    capped: Tensor | None  # (n, V): secant scale ẑ/z where logits are soft-capped
    block_bytes: int
    parallel: bool = False  # the feed-forward block reads x^l, not y (GPT-NeoX)


def first_tensor(value: Any) -> Tensor:
    """A module's output tensor, or the first element of a tuple output."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, tuple | list) and value and isinstance(value[0], Tensor):
        return value[0]
    raise UnsupportedModelError(f"expected a tensor output, got {type(value).__name__}")


class _Recorder:
    """Capture observer and module hooks that collect :class:`LayerFactors`."""

    def __init__(
        self,
        model: LoadedModel,
        positions: Tensor,
        dtype: torch.dtype,
        keep_states: bool,
    ) -> None:
        self.model = model
        self.spec = model.family
        self.positions = positions
        self.dtype = dtype
        self.keep_states = keep_states
        self.layers_list = self.spec.decoder_layers(model.model)
        self.factors = [LayerFactors() for _ in self.layers_list]
        self._x: dict[int, Tensor] = {}
        self._o: dict[int, Tensor] = {}
        self._n: dict[int, Tensor] = {}
        self.x0_rows: Tensor | None = None
        self.final_in: Tensor | None = None
        self.final_out: Tensor | None = None

    # ---- capture observer: keep the call, let the layer run on sdpa -------------------
    def wants(self, layer_idx: int) -> bool:
        return False

    def skipped(self, call: LayerCall) -> None:
        self.factors[call.layer_idx].call = call

    def observe(self, view: LayerBlock) -> None:  # soft-capped layers run eagerly
        self.factors[view.layer_idx].call = view.call

    # ---- module hooks -------------------------------------------------------------------
    @contextmanager
    def hooks(self) -> Iterator[None]:
        handles = []
        try:
            for idx, layer in enumerate(self.layers_list):
                handles.append(layer.register_forward_pre_hook(self._pre(idx), with_kwargs=True))
                attn = self.spec.attention_module(layer)
                proj = getattr(attn, self.spec.output_projection)
                handles.append(proj.register_forward_hook(self._keep(self._o, idx)))
                if self.spec.attention_output_norm is not None:
                    norm = getattr(layer, self.spec.attention_output_norm)
                    handles.append(norm.register_forward_hook(self._keep(self._n, idx)))
                handles.append(layer.register_forward_hook(self._post(idx)))
            final = self.spec.final_norm_module(self.model.model)
            handles.append(final.register_forward_hook(self._final))
            yield
        finally:
            for h in handles:
                h.remove()

    def _pre(self, idx: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            x = args[0] if args else kwargs["hidden_states"]
            self._x[idx] = x.detach()[0]
            if idx == 0:
                self.x0_rows = self._x[0][self.positions].to(self.dtype)

        return hook

    @staticmethod
    def _keep(store: dict[int, Tensor], idx: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            store[idx] = first_tensor(out).detach()[0]

        return hook

    def _final(self, module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        self.final_in = args[0].detach()[0][self.positions]
        self.final_out = first_tensor(out).detach()[0][self.positions]

    def _post(self, idx: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            self._layer_done(idx, module, first_tensor(out).detach()[0])

        return hook

    def _layer_done(self, idx: int, layer: nn.Module, x_next: Tensor) -> None:
        dt = self.dtype
        f = self.factors[idx]
        x = self._x.pop(idx).to(dt)
        o = self._o.pop(idx).to(dt)
        attn = self.spec.attention_module(layer)
        weight, bias = self.spec.output_weight(attn)
        num_heads = f.call.num_heads if f.call is not None else _num_heads(self.model)
        w_o = split_output_weight(weight.detach().to(x.device, dt), num_heads)
        b_o = None if bias is None else bias.detach().to(x.device, dt)
        s: Tensor | None = None
        if self.spec.attention_output_norm is not None:
            n = self._n.pop(idx)
            norm = getattr(layer, self.spec.attention_output_norm)
            lin = linearise_norm(norm, o, n, dt)
            s = lin.scale
            y = x + n.to(dt)
        else:
            y = x + o
        inv = reciprocal(y.square().sum(-1))  # (T,)
        scaled = (y if s is None else s * y) * inv[:, None]
        f.back = torch.einsum("td,hde->the", scaled, w_o)
        f.rho = (y * x).sum(-1) * inv
        if b_o is not None:
            f.beta = (scaled * b_o).sum(-1)
        f.w_o, f.b_o = w_o, b_o
        rows = self.positions
        f.y_rows = y[rows]
        f.m_rows = x_next.to(dt)[rows] - y[rows]
        f.s_rows = None if s is None else s[rows]
        if self.keep_states:
            f.x, f.y, f.s = x, y, s


def _num_heads(model: LoadedModel) -> int:
    return model.num_heads


def forward_factors(
    model: LoadedModel,
    ids: Tensor,
    targets: Sequence[Target],
    *,
    dtype: torch.dtype = torch.float32,
    keep_states: bool = False,
    block_bytes: int = 32 * 1024**2,
) -> tuple[FlowForward, list[Target]]:
    """Run the forward once and collect every layer's factors (and resolve the targets'
    tokens from the model's own logits)."""
    device = model.device
    positions = torch.tensor([t.position for t in targets], dtype=torch.long, device=device)
    rec = _Recorder(model, positions, dtype, keep_states)
    with (
        capturing(model.model, [rec], block_bytes=block_bytes) as session,
        rec.hooks(),
        torch.no_grad(),
    ):
        model.model(input_ids=ids[None].to(device), use_cache=False, **model.last_logits_only())
    check_all_layers_seen(session, len(rec.layers_list))
    if rec.final_in is None or rec.final_out is None or rec.x0_rows is None:
        raise UnsupportedModelError(
            f"the final norm {model.family.final_norm!r} never ran; fix final_norm in the "
            "model's FamilySpec"
        )
    final = linearise_norm(
        model.family.final_norm_module(model.model), rec.final_in, rec.final_out, dtype
    )
    unembed = model.model.get_output_embeddings()
    with torch.no_grad():
        raw = unembed(rec.final_out).to(dtype)
    cap = getattr(model.text_config, "final_logit_softcapping", None)
    capped = None
    logits = raw
    if cap:
        logits = torch.tanh(raw / cap) * cap
        capped = torch.where(raw.abs() > 1e-12, logits / raw, torch.ones_like(raw))
    resolved = resolve(targets, logits)
    fwd = FlowForward(
        layers=rec.factors,
        positions=positions,
        x0_rows=rec.x0_rows,
        final_x=rec.final_in.to(dtype),
        final_norm=final,
        logits=logits,
        capped=capped,
        block_bytes=block_bytes,
        parallel=bool(getattr(model.text_config, "use_parallel_residual", False)),
    )
    return fwd, resolved


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


@dataclass
class FlowOutput:
    """Per target: the attribution over input tokens and what it decomposes."""

    scores: Tensor  # (n, T)
    targets: list[Target]
    values: Tensor  # (n,) the targets' exact values (NaN for flow)
    explained: Tensor  # (n,) the decomposed value ⟨w, x_p^L⟩ + c (NaN for flow)
    remainder: Tensor  # (n,) what no token receives (biases; the constant c)
    layer_rows: list[Tensor] = field(default_factory=list)  # r^l per layer, top first


def _values_of(call: LayerCall, keys: slice, dtype: torch.dtype) -> Tensor:
    v = call._expanded(call.value)[0, :, keys]  # (H, K, d_h)
    return v.to(dtype)


def _probs(call: LayerCall, rows: slice, keys: slice, dtype: torch.dtype) -> Tensor:
    return call.probs(rows, keys=keys)[0].to(dtype)  # (H, I, K)


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
            probs = _probs(call, rows, keys, dt)  # (H, I, K)
            carried = weights[:, :, None, None] * f.back[rows][None]  # (n, I, H, d_h)
            z = torch.einsum("hik,nihd->nhkd", probs, carried)
            out[:, keys] += torch.einsum("nhkd,hkd->nk", z, _values_of(call, keys, dt))
        return out
    if rule == "rollout":
        out = 0.5 * r
        for rows in _blocks(call, stop, block_bytes):
            weights = r[:, rows]
            if not bool(weights.any()):
                continue
            keys = slice(0, rows.stop)
            mean = _probs(call, rows, keys, dt).mean(0)  # (I, K)
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
    values = _values_of(call, slice(0, stop), dt)  # (H, T', d_h)
    projected = torch.einsum("hkd,hed->hke", values, f.w_o)  # (H, T', d)
    for start in range(0, stop, step):
        rows = slice(start, min(stop, start + step))
        weights = r[:, rows]
        if not bool(weights.any()):
            continue
        keys = slice(0, rows.stop)
        probs = _probs(call, rows, keys, dt)  # (H, I, K)
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
    probs = _probs(call, slice(lo, hi), keys, dtype)  # (H, R, K)
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
    cv = torch.einsum("nhe,hke->nhk", coef, _values_of(call, keys, dtype))
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


def head_rows(f: LayerFactors, row: int, stop: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Row ``row`` of layer l's mixing matrix split by head: ``(H, stop)`` shares
    A_ij^(l,h) and the residual share ρ_i (method §7.1)."""
    call = f.call
    assert call is not None and f.back is not None and f.rho is not None
    keys = slice(0, stop)
    probs = _probs(call, slice(row, row + 1), keys, dtype)[:, 0]  # (H, K)
    dots = torch.einsum("hd,hkd->hk", f.back[row], _values_of(call, keys, dtype))
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
