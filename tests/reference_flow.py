"""An independent, naive float64 implementation of contribution flow (docs/method.md §7).

Nothing here comes from :mod:`contribution_weights.attribution` or
:mod:`contribution_weights.capture`: the model runs on its own eager attention
(``output_attentions=True``) with plain forward hooks on the decoder layers, the attention
modules' value source and output projection, the post-attention norm of the families that
have one and the final norm (located by :mod:`reference`'s table and this file's own). Then
every object of §7 is built explicitly: the ``(T, T)`` mixing matrix ``A^l`` of each layer
from the ``(H, T, T, d)`` tensor of its terms ``α_ij^(h) s_i ⊙ ṽ_j^(h)``, the flows
``F^l = A^(l−1) ⋯ A^0`` as matrix products, and the target's attribution as the sum of §7.3
over layers and tokens (no Horner rule, no row vector carried down).

Shapes: ``T`` tokens, ``H`` query heads, ``G`` KV heads, ``d_h`` head dim, ``d`` model dim,
``V`` vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from reference import attention_modules, layout, output_weight, projected_values
from torch import Tensor, nn

F64 = torch.float64

# families whose RMSNorm multiplies by (1 + weight) instead of weight
_ONE_PLUS = ("gemma", "gemma2", "gemma3_text")
# families that normalise the attention output before the residual add (method §7.1)
_ATTENTION_OUTPUT_NORM = {
    "gemma2": "post_attention_layernorm",
    "gemma3_text": "post_attention_layernorm",
}
_FINAL_NORM = {"gpt2": "transformer.ln_f", "gpt_neox": "gpt_neox.final_layer_norm"}


def _walk(root: Any, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part)
    return root


def decoder_layers(model: Any) -> list[nn.Module]:
    return list(_walk(model, layout(model.config.model_type).layers))


def final_norm(model: Any) -> nn.Module:
    return _walk(model, _FINAL_NORM.get(model.config.model_type, "model.norm"))


def _pm(x: Tensor, y: Tensor) -> Tensor:
    """Row-wise ⟨x, y⟩ / ‖x‖² (0 where x = 0): the projection share π of method §7.1."""
    n2 = (x * x).sum(-1)
    dots = (x * y).sum(-1)
    return torch.where(n2 == 0, torch.zeros_like(dots), dots / torch.where(n2 == 0, 1.0, n2))


@dataclass(frozen=True)
class Norm:
    """A norm as the maths reads it: RMSNorm ``g ⊙ x / rms(x)``, or LayerNorm
    ``g ⊙ (x − mean x) / σ(x) + b``."""

    gain: Tensor  # (d,)
    eps: float
    centred: bool
    bias: Tensor | None

    def scale(self, x: Tensor) -> Tensor:
        """``(..., d)``: the per-position scale ``g / rms(x)`` (or ``g / σ(x)``)."""
        x = x.to(F64)
        if self.centred:
            x = x - x.mean(-1, keepdim=True)
        return self.gain / (x.square().mean(-1, keepdim=True) + self.eps).sqrt()

    def __call__(self, x: Tensor) -> Tensor:
        x = x.to(F64)
        centred = x - x.mean(-1, keepdim=True) if self.centred else x
        out = self.scale(x) * centred
        return out if self.bias is None else out + self.bias


def norm_of(module: Any, model_type: str) -> Norm:
    """The norm's maths read from its parameters (this file's table of conventions)."""
    if isinstance(module, nn.LayerNorm):
        bias = None if module.bias is None else module.bias.detach().to(F64)
        return Norm(module.weight.detach().to(F64), float(module.eps), True, bias)
    weight = module.weight.detach().to(F64)
    gain = 1.0 + weight if model_type in _ONE_PLUS else weight
    eps = getattr(module, "eps", None)
    if eps is None:
        eps = module.variance_epsilon
    return Norm(gain, float(eps), False, None)


@dataclass
class Layer:
    """One decoder layer, every object of method §7.1 built explicitly."""

    x: Tensor  # (T, d) the layer's input x^l
    x_next: Tensor  # (T, d) its output x^(l+1)
    probs: Tensor  # (H, T, T) α
    projected: Tensor  # (H, T, d) ṽ_j^(h)
    scale: Tensor  # (T, d) s_i (ones without a post-attention norm)
    bias: Tensor  # (d,) b_O (zeros without one)
    y: Tensor  # (T, d) x + s ⊙ o
    terms: Tensor  # (H, T, T, d) α_ij^(h) s_i ⊙ ṽ_j^(h)
    heads: Tensor  # (H, T, T) A^(l,h) = π_i(terms)
    rho: Tensor  # (T,) π_i(x_i)
    mixing: Tensor  # (T, T) A^l
    beta: Tensor  # (T,) π_i(s_i ⊙ b_O)
    ffn: Tensor  # (T, d) m = x^(l+1) − y

    def augmented(self) -> Tensor:
        """``(T+1, T+1)``: A^l with the bias as an extra node that keeps what it gets (so
        the matrix is row-stochastic)."""
        t = self.mixing.shape[0]
        out = torch.zeros(t + 1, t + 1, dtype=F64)
        out[:t, :t] = self.mixing
        out[:t, t] = self.beta
        out[t, t] = 1.0
        return out


def build_layer(
    x: Tensor,
    x_next: Tensor,
    probs: Tensor,
    values: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    scale: Tensor | None,
) -> Layer:
    """Method §7.1 by brute force from α ``(H, T, T)``, v ``(G, T, d_h)``, the output
    projection ``(d, H*d_h)`` and its bias, and the post-attention norm's scale ``(T, d)``."""
    x, x_next, a = x.to(F64), x_next.to(F64), probs.to(F64)
    vt = projected_values(values, weight)  # (H, T, d)
    t, d = x.shape
    s = torch.ones(t, d, dtype=F64) if scale is None else scale.to(F64)
    b = torch.zeros(d, dtype=F64) if bias is None else bias.to(F64)
    terms = a[..., None] * vt[:, None] * s[None, :, None]  # (H, I, J, d)
    o = (a[..., None] * vt[:, None]).sum((0, 2)) + b
    y = x + s * o
    heads = _pm(y[None, :, None, :].expand_as(terms), terms)  # (H, I, J)
    rho = _pm(y, x)
    beta = _pm(y, s * b)
    mixing = heads.sum(0) + torch.diag(rho)
    return Layer(
        x=x,
        x_next=x_next,
        probs=a,
        projected=vt,
        scale=s,
        bias=b,
        y=y,
        terms=terms,
        heads=heads,
        rho=rho,
        mixing=mixing,
        beta=beta,
        ffn=x_next - y,
    )


@dataclass
class Run:
    """The eager model's forward, and what §7 reads from it."""

    layers: list[Layer]
    x0: Tensor  # (T, d) input of layer 0
    x_final: Tensor  # (T, d) x^L, input of the final norm
    norm: Norm  # the final norm
    norm_out: Tensor  # (T, d) the final norm's output (hooked)
    unembed: Tensor  # (V, d)
    unembed_bias: Tensor | None  # (V,)
    softcap: float | None
    logits: Tensor  # (T, V) the eager model's logits (soft-capped where it caps)
    raw_logits: Tensor  # (T, V) U n(x^L) + bias, before any soft-capping
    outputs: list[Tensor]  # (T, d) per layer: the output projection's output (hooked)
    normed: list[Tensor | None]  # (T, d) per layer: the post-attention norm's output
    parallel: bool = False  # the feed-forward block reads x^l, not y (GPT-NeoX)

    def flows(self) -> list[Tensor]:
        """``F^0 = I, F^1, …, F^L`` as explicit products of the mixing matrices."""
        t = self.x0.shape[0]
        out = [torch.eye(t, dtype=F64)]
        for layer in self.layers:
            out.append(layer.mixing @ out[-1])
        return out

    def augmented_flows(self) -> list[Tensor]:
        """The same with the bias node (last column: the share that comes from biases)."""
        t = self.x0.shape[0]
        out = [torch.eye(t + 1, dtype=F64)]
        for layer in self.layers:
            out.append(layer.augmented() @ out[-1])
        return out


def _first(value: Any) -> Tensor:
    return value if isinstance(value, Tensor) else value[0]


def eager_flow_run(model: Any, input_ids: Tensor) -> Run:
    """Run the model (a causal LM, one sequence ``(T,)``) on its own eager attention with
    plain hooks, and build every layer of method §7.1; restores the attention setting."""
    cfg = model.config
    kind = cfg.model_type
    lay = layout(kind)
    layers = decoder_layers(model)
    modules = attention_modules(model)
    n = len(layers)
    store: dict[str, list[Any]] = {k: [None] * n for k in ("x", "x_next", "v", "o", "n")}
    final: dict[str, Tensor] = {}
    handles = []

    def keep(key: str, idx: int, fn: Callable[[Any], Tensor]) -> Callable[..., None]:
        def hook(_m: nn.Module, _args: Any, out: Any) -> None:
            store[key][idx] = fn(out).detach()

        return hook

    def keep_input(idx: int) -> Callable[..., None]:
        def hook(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            store["x"][idx] = (args[0] if args else kwargs["hidden_states"]).detach()[0]

        return hook

    def on_final(_m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        final["in"] = args[0].detach()[0]
        final["out"] = _first(out).detach()[0]

    post_norm = _ATTENTION_OUTPUT_NORM.get(kind)
    for idx, (layer, attn) in enumerate(zip(layers, modules, strict=True)):
        handles.append(layer.register_forward_pre_hook(keep_input(idx), with_kwargs=True))
        handles.append(layer.register_forward_hook(keep("x_next", idx, lambda o: _first(o)[0])))
        handles.append(
            getattr(attn, lay.value_source).register_forward_hook(
                keep("v", idx, lambda o: lay.values(o, cfg)[0])
            )
        )
        handles.append(
            getattr(attn, lay.projection).register_forward_hook(keep("o", idx, lambda o: o[0]))
        )
        if post_norm is not None:
            norm_module = getattr(layer, post_norm)
            handles.append(norm_module.register_forward_hook(keep("n", idx, lambda o: o[0])))
    handles.append(final_norm(model).register_forward_hook(on_final))
    previous = cfg._attn_implementation
    try:
        model.set_attn_implementation("eager")
        with torch.no_grad():
            out = model(input_ids=input_ids[None], output_attentions=True, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
        model.set_attn_implementation(previous)

    built = []
    for idx, layer in enumerate(layers):
        weight, bias = output_weight(model, idx)
        scale = None
        o = store["o"][idx].to(F64)
        if post_norm is not None:
            scale = norm_of(getattr(layer, post_norm), kind).scale(o)
        built.append(
            build_layer(
                store["x"][idx],
                store["x_next"][idx],
                out.attentions[idx][0],
                store["v"][idx],
                weight,
                bias,
                scale,
            )
        )
    head = model.get_output_embeddings()
    u = head.weight.detach().to(F64)
    u_bias = None if getattr(head, "bias", None) is None else head.bias.detach().to(F64)
    raw = final["out"].to(F64) @ u.T + (0 if u_bias is None else u_bias)
    return Run(
        layers=built,
        x0=store["x"][0].to(F64),
        x_final=final["in"].to(F64),
        norm=norm_of(final_norm(model), kind),
        norm_out=final["out"].to(F64),
        unembed=u,
        unembed_bias=u_bias,
        softcap=getattr(cfg, "final_logit_softcapping", None) or None,
        logits=out.logits.detach()[0].to(F64),
        raw_logits=raw,
        outputs=[o.to(F64) for o in store["o"]],
        normed=[None if v is None else v.to(F64) for v in store["n"]],
        parallel=bool(getattr(cfg, "use_parallel_residual", False)),
    )


# ---- method §7.2-7.3 ------------------------------------------------------------------------
def pure_flow(run: Run, position: int) -> Tensor:
    """``(T,)``: row p of F = A^(L−1) ⋯ A^0."""
    return run.flows()[-1][position]


def coefficients(
    run: Run, position: int, quantity: str, token: int, foil: int | None = None
) -> Tensor:
    """``(V,)``: the target as a combination of the logits, Σ_v c_v ẑ_v, with each c_v
    already multiplied by the soft-cap secant ẑ_v / z_v (so that Σ_v c_v z_v = target's
    linear part)."""
    v = run.unembed.shape[0]
    coef = torch.zeros(v, dtype=F64)
    if quantity == "logit":
        coef[token] = 1.0
    elif quantity == "contrast":
        assert foil is not None
        coef[token] = 1.0
        coef[foil] = -1.0
    elif quantity == "logprob":
        coef = -torch.softmax(run.logits[position], -1)
        coef[token] += 1.0
    else:
        raise ValueError(quantity)
    if run.softcap is not None:
        z = run.raw_logits[position]
        capped = run.softcap * torch.tanh(z / run.softcap)
        # the secant ẑ/z, 1 in the limit z → 0 (a zero row of U, e.g. a padding token)
        zero = z == 0
        coef = coef * torch.where(zero, 1.0, capped / torch.where(zero, 1.0, z))
    return coef


def readout(
    run: Run, position: int, quantity: str, token: int, foil: int | None = None
) -> tuple[Tensor, float]:
    """``w`` ``(d,)`` and ``c`` with the target's linear part = ⟨w, x_p^L⟩ + c (method §7.3):
    the final norm linearised at x_p^L, the unembedding rows combined."""
    coef = coefficients(run, position, quantity, token, foil)
    w_tilde = coef @ run.unembed  # (d,)
    const = 0.0 if run.unembed_bias is None else float(coef @ run.unembed_bias)
    norm = run.norm
    w = norm.scale(run.x_final[position]) * w_tilde
    if norm.centred:  # ⟨w̃, s ⊙ C x⟩ = ⟨C (s ⊙ w̃), x⟩, C symmetric
        d = w.shape[0]
        centring = torch.eye(d, dtype=F64) - torch.full((d, d), 1.0 / d, dtype=F64)
        w = centring @ w
    if norm.bias is not None:
        const += float(w_tilde @ norm.bias)
    return w, const


@dataclass
class Attribution:
    scores: Tensor  # (T,) a_k
    bias: float  # what the biases (and the norm's constant) receive
    explained: float  # ⟨w, x_p^L⟩ + c


def attribution(
    run: Run, position: int, w: Tensor, const: float, composed: bool = True
) -> Attribution:
    """Method §7.3 summed term by term (``composed=False``: §7.6's direct rule, every
    flow F^l the identity):

    a_k = ⟨w, x_p^0⟩ δ_pk + Σ_l [ Σ_j D_j^l F_jk^l + μ^l (A^l F^l)_pk ],

    (μ^l F_pk^l in parallel-residual families, whose feed-forward block reads x^l),

    and, with the bias as an extra node of every A^l (so that the rows sum to 1), what the
    biases receive: c + Σ_l [ ⟨w, s_p ⊙ b_O^l⟩ + Σ_j D_j^l F̂_j,bias^l + μ^l (Â^l F̂^l)_p,bias ].
    """
    p = position
    t = run.x0.shape[0]
    flows, hats = run.flows(), run.augmented_flows()
    if not composed:
        flows = [torch.eye(t, dtype=F64) for _ in flows]
        hats = [torch.eye(t + 1, dtype=F64) for _ in hats]
    scores = torch.zeros(t, dtype=F64)
    scores[p] += w @ run.x0[p]
    bias = const
    for idx, layer in enumerate(run.layers):
        direct = torch.einsum("hjd,d->j", layer.terms[:, p], w)  # D_j^l
        mu = float(layer.ffn[p] @ w)
        hat = hats[idx]
        bias += float(layer.scale[p] * layer.bias @ w)
        bias += float(direct @ hat[:t, t])
        if run.parallel:  # the feed-forward block read x^l: it is shared like x_p^l
            scores += direct @ flows[idx] + mu * flows[idx][p]
            bias += mu * float(hat[p, t])
        else:  # it read y_p: shared like y_p
            scores += direct @ flows[idx] + mu * (layer.mixing @ flows[idx])[p]
            bias += mu * float((layer.augmented() @ hat)[p, t])
    explained = float(w @ run.x_final[p]) + const
    return Attribution(scores, bias, explained)


def target_attribution(
    run: Run,
    position: int,
    quantity: str,
    token: int,
    foil: int | None = None,
    composed: bool = True,
) -> Attribution:
    w, const = readout(run, position, quantity, token, foil)
    return attribution(run, position, w, const, composed)


# ---- method §7.5: the baselines --------------------------------------------------------------
def rollout(run: Run, position: int) -> Tensor:
    """``(T,)``: row p of Π_l (½ mean_h α^l + ½ I)."""
    t = run.x0.shape[0]
    f = torch.eye(t, dtype=F64)
    for layer in run.layers:
        f = (0.5 * layer.probs.mean(0) + 0.5 * torch.eye(t, dtype=F64)) @ f
    return f[position]


def alti_matrix(layer: Layer) -> Tensor:
    """``(T, T)``: max(0, ‖y_i‖₁ − ‖y_i − T_ij‖₁), rows normalised to 1, with
    T_ij = Σ_h α_ij^(h) s_i ⊙ ṽ_j^(h) + δ_ij x_i."""
    t = layer.x.shape[0]
    terms = layer.terms.sum(0).clone()  # (I, J, d)
    for i in range(t):
        terms[i, i] += layer.x[i]
    y = layer.y[:, None, :]
    c = (y.abs().sum(-1) - (y - terms).abs().sum(-1)).clamp_min(0)
    total = c.sum(-1, keepdim=True)
    return torch.where(total == 0, torch.zeros_like(c), c / torch.where(total == 0, 1.0, total))


def alti(run: Run, position: int) -> Tensor:
    t = run.x0.shape[0]
    f = torch.eye(t, dtype=F64)
    for layer in run.layers:
        f = alti_matrix(layer) @ f
    return f[position]


# ---- a one-layer model by hand (no hooks, no forward of the model's own) ----------------------
@dataclass
class OneLayer:
    """A one-layer Llama or Gemma 2 computed from its weights alone."""

    x0: Tensor  # (T, d) embeddings (scaled in Gemma)
    probs: Tensor  # (H, T, T)
    values: Tensor  # (G, T, d_h)
    w_o: Tensor  # (d, H*d_h)
    b_o: Tensor  # (d,) zeros without a bias
    scale: Tensor  # (T, d) post-attention norm scale s_i (ones in Llama)
    y: Tensor  # (T, d)
    ffn: Tensor  # (T, d) m
    x1: Tensor  # (T, d)
    final_scale: Tensor  # (T, d) g_f / rms(x1)
    raw_logits: Tensor  # (T, V) before soft-capping
    logits: Tensor  # (T, V) after it


def _w(module: Any) -> Tensor:
    return module.weight.detach().to(F64)


def _b(module: Any, size: int) -> Tensor:
    bias = getattr(module, "bias", None)
    return torch.zeros(size, dtype=F64) if bias is None else bias.detach().to(F64)


def _rms(x: Tensor, eps: float) -> Tensor:
    return (x.square().mean(-1, keepdim=True) + eps).sqrt()


def _rope(x: Tensor, theta: float) -> Tensor:
    """Rotary embedding of ``(heads, T, d_h)``, halves rotated (Llama's convention)."""
    d_h, t = x.shape[-1], x.shape[-2]
    inv = 1.0 / theta ** (torch.arange(0, d_h, 2, dtype=F64) / d_h)
    angles = torch.arange(t, dtype=F64)[:, None] * inv[None]
    emb = torch.cat([angles, angles], -1)
    rotated = torch.cat([-x[..., d_h // 2 :], x[..., : d_h // 2]], -1)
    return x * emb.cos() + rotated * emb.sin()


def one_layer_by_hand(model: Any, ids: Tensor) -> OneLayer:
    """The forward of a one-layer ``llama`` or ``gemma2`` causal LM, written out."""
    cfg = model.config
    kind = cfg.model_type
    assert kind in ("llama", "gemma2") and cfg.num_hidden_layers == 1
    gemma = kind == "gemma2"
    inner = model.model
    layer = inner.layers[0]
    attn = layer.self_attn
    t, d = len(ids), cfg.hidden_size
    n_h, n_g = cfg.num_attention_heads, cfg.num_key_value_heads
    d_h = getattr(cfg, "head_dim", None) or d // n_h
    eps = cfg.rms_norm_eps

    def gain(norm: Any) -> Tensor:
        return 1.0 + _w(norm) if gemma else _w(norm)

    x0 = _w(inner.embed_tokens)[ids]
    if gemma:
        x0 = x0 * math.sqrt(d)
    h = gain(layer.input_layernorm) * x0 / _rms(x0, eps)
    q = (h @ _w(attn.q_proj).T + _b(attn.q_proj, n_h * d_h)).view(t, n_h, d_h).transpose(0, 1)
    k = (h @ _w(attn.k_proj).T + _b(attn.k_proj, n_g * d_h)).view(t, n_g, d_h).transpose(0, 1)
    v = (h @ _w(attn.v_proj).T + _b(attn.v_proj, n_g * d_h)).view(t, n_g, d_h).transpose(0, 1)
    theta = float(cfg.rope_parameters["rope_theta"])
    q, k = _rope(q, theta), _rope(k, theta)
    k = k.repeat_interleave(n_h // n_g, 0)
    scores = q @ k.transpose(1, 2)
    scores = scores * (cfg.query_pre_attn_scalar**-0.5 if gemma else d_h**-0.5)
    if gemma and cfg.attn_logit_softcapping:
        scores = cfg.attn_logit_softcapping * torch.tanh(scores / cfg.attn_logit_softcapping)
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    ok = j <= i
    if gemma and cfg.layer_types[0] == "sliding_attention":
        ok = ok & (i - j < cfg.sliding_window)
    probs = torch.softmax(scores.masked_fill(~ok, -math.inf), -1)
    heads = probs @ v.repeat_interleave(n_h // n_g, 0)  # (H, T, d_h)
    w_o, b_o = _w(attn.o_proj), _b(attn.o_proj, d)
    o = heads.transpose(0, 1).reshape(t, n_h * d_h) @ w_o.T + b_o
    if gemma:
        scale = gain(layer.post_attention_layernorm) / _rms(o, eps)
        scale = scale.expand(t, d)
        mlp_in = gain(layer.pre_feedforward_layernorm)
    else:
        scale = torch.ones(t, d, dtype=F64)
        mlp_in = gain(layer.post_attention_layernorm)
    y = x0 + scale * o
    z = mlp_in * y / _rms(y, eps)
    mlp = layer.mlp
    act = (
        nn.functional.gelu(z @ _w(mlp.gate_proj).T, approximate="tanh")
        if gemma
        else nn.functional.silu(z @ _w(mlp.gate_proj).T)
    )
    m = (act * (z @ _w(mlp.up_proj).T)) @ _w(mlp.down_proj).T
    if gemma:
        m = gain(layer.post_feedforward_layernorm) * m / _rms(m, eps)
    x1 = y + m
    final_scale = (gain(inner.norm) / _rms(x1, eps)).expand(t, d)
    raw = (final_scale * x1) @ _w(model.lm_head).T
    cap = getattr(cfg, "final_logit_softcapping", None)
    logits = cap * torch.tanh(raw / cap) if cap else raw
    return OneLayer(x0, probs, v, w_o, b_o, scale, y, m, x1, final_scale, raw, logits)
