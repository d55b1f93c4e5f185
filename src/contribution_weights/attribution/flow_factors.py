"""What contribution flow's top-down pass reads (method §7.2), recorded by one forward.

One forward pass runs every attention layer on the model's own sdpa kernel and keeps, per
layer, what the top-down pass needs: the layer's call (queries, keys, values, mask: the
attention probabilities are recomputed block by block, exactly as eager computes them),
the factor ``b_i^(h) = W_O^(h)ᵀ (s_i ⊙ y_i) / ‖y_i‖²`` and the residual share ``ρ_i``, and
at each target position the few vectors the logit projection reads
(:func:`forward_factors`). The norms are linearised at their inputs
(:func:`linearise_norm`). :class:`FlowOutput` is what the pass
(:func:`~.flow.propagate`) returns.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..capture import LayerBlock, LayerCall, capturing, check_all_layers_seen
from ..families import UnsupportedModelError
from ..loading import LoadedModel
from ..measures.layer import reciprocal, split_output_weight
from .targets import Target, resolve


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


@dataclass
class FlowOutput:
    """Per target: the attribution over input tokens and what it decomposes."""

    scores: Tensor  # (n, T)
    targets: list[Target]
    values: Tensor  # (n,) the targets' exact values (NaN for flow)
    explained: Tensor  # (n,) the decomposed value ⟨w, x_p^L⟩ + c (NaN for flow)
    remainder: Tensor  # (n,) what no token receives (biases; the constant c)
    layer_rows: list[Tensor] = field(default_factory=list)  # r^l per layer, top first


def values_at(call: LayerCall, keys: slice, dtype: torch.dtype) -> Tensor:
    """The layer's values at ``keys``, one per head: ``(H, K, d_h)``."""
    v = call._expanded(call.value)[0, :, keys]  # (H, K, d_h)
    return v.to(dtype)


def probs_at(call: LayerCall, rows: slice, keys: slice, dtype: torch.dtype) -> Tensor:
    """The layer's attention probabilities of queries ``rows`` over ``keys``: ``(H, I, K)``."""
    return call.probs(rows, keys=keys)[0].to(dtype)  # (H, I, K)
