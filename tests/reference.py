"""An independent brute-force float64 implementation of method §2-3, for cross-checking.

Nothing here is shared with the package's maths or capture: the attention probabilities
come from the model's own eager attention (``output_attentions=True``), the value
vectors and the output projection's output from plain forward hooks on the family's
modules (located by this file's own table, not by :mod:`contribution_weights.families`),
and every measure is computed the naive way, by materialising each projected value
``ṽ_j^(h) = W_O^(h) v_j^(g(h))`` and each weighted term ``α_ij ṽ_j^(h)``.

Shapes: ``H`` query heads, ``G`` KV heads, ``I`` queries, ``T`` keys, ``d_h`` head dim,
``d`` model dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

F64 = torch.float64


# ---- the naive per-layer measures ----------------------------------------------------------
def _div(num: Tensor, den: Tensor) -> Tensor:
    """num / den where den != 0, else 0 (docs/method.md §2: the degenerate-case convention)."""
    zero = den == 0
    return torch.where(zero, torch.zeros_like(num), num / torch.where(zero, 1.0, den))


def projected_values(values: Tensor, weight: Tensor) -> Tensor:
    """``(H, T, d)`` ṽ_j^(h) = W_O^(h) v_j^(g(h)), head by head.

    ``values`` is ``(G, T, d_h)``; ``weight`` is the output projection as a linear map
    ``(d, H*d_h)`` (columns ``h*d_h … (h+1)*d_h`` belong to head h).
    """
    g_heads, t, d_h = values.shape
    d = weight.shape[0]
    h_heads = weight.shape[1] // d_h
    out = torch.zeros(h_heads, t, d, dtype=F64)
    for h in range(h_heads):
        g = h // (h_heads // g_heads)
        w_h = weight[:, h * d_h : (h + 1) * d_h].to(F64)
        for j in range(t):
            out[h, j] = w_h @ values[g, j].to(F64)
    return out


def reference_layer(
    probs: Tensor, values: Tensor, weight: Tensor, bias: Tensor | None, valid: Tensor
) -> dict[str, Tensor]:
    """Every quantity of method §2 for one layer and one sequence, in float64.

    Args:
        probs: ``(H, I, T)`` attention probabilities of I queries.
        values: ``(G, T, d_h)``.
        weight: ``(d, H*d_h)`` output projection (linear layout); bias ``(d,)`` or None.
        valid: ``(I, T)`` bool, where query i may attend to key j (r and κ are 0 elsewhere).

    Returns measures ``(H, I, T)`` under their registry names, plus ``output`` ``(I, d)``,
    ``head_outputs`` ``(H, I, d)``, and ``(I,)``: ``bias_share``, ``degenerate``,
    ``output_l1`` (‖o_i‖₁) and ``distance_total`` (the sum of D before it is normalised).
    """
    a = probs.to(F64)
    vt = projected_values(values, weight)  # (H, T, d)
    weighted = a[..., None] * vt[:, None]  # (H, I, T, d): α_ij ṽ_j^(h)
    head_out = weighted.sum(dim=2)  # (H, I, d)
    b = torch.zeros(vt.shape[-1], dtype=F64) if bias is None else bias.to(F64)
    o = head_out.sum(dim=0) + b  # (I, d)
    o_n2 = (o * o).sum(-1)  # (I,)
    o_n = o_n2.sqrt()
    h_n2 = (head_out * head_out).sum(-1)  # (H, I)
    v_n = vt.norm(dim=-1)  # (H, T)
    keep = valid[None].expand_as(a)
    zero = torch.zeros((), dtype=F64)

    contribution = _div(torch.einsum("hitd,id->hit", weighted, o), o_n2[None, :, None])
    intra = _div(torch.einsum("hitd,hid->hit", weighted, head_out), h_n2[:, :, None])
    r = torch.where(keep, _div(v_n[:, None, :], o_n[None, :, None]), zero)
    dots = torch.einsum("htd,id->hit", vt, o)
    cos = torch.where(keep, _div(dots, v_n[:, None, :] * o_n[None, :, None]), zero)
    vw = a * v_n[:, None, :]
    vw_on = _div(vw, o_n[None, :, None])
    l1 = o.abs().sum(-1)  # (I,)
    rest = (o[None, :, None, :] - weighted).abs().sum(-1)  # (H, I, T)
    raw = torch.where(keep, (l1[None, :, None] - rest).clamp_min(0), zero)
    dist = _div(raw, raw.sum(dim=(0, 2), keepdim=True))
    return {
        "attention": a,
        "contribution": contribution,
        "intra": intra,
        "relative_norm": r,
        "cosine": cos,
        "vw": vw,
        "vw_on": vw_on,
        "distance": dist,
        "ihc": contribution.abs(),
        "output": o,
        "head_outputs": head_out,
        "distance_total": raw.sum(dim=(0, 2)),  # (I,): Σ_h Σ_j of D before normalising
        "output_l1": l1,
        "bias_share": _div(o @ b, o_n2),
        "degenerate": o_n2 == 0,
    }


def scalar_contribution(
    probs: Tensor, values: Tensor, weight: Tensor, bias: Tensor | None, h: int, i: int, j: int
) -> float:
    """ĉ_ij^(h) with Python floats only (a check of :func:`reference_layer` itself)."""
    n_h = probs.shape[0]
    g_heads, t, d_h = values.shape
    d = weight.shape[0]
    w = weight.tolist()
    vals = values.tolist()
    p = probs.tolist()

    def vtilde(head: int, key: int) -> list[float]:
        g = head // (n_h // g_heads)
        return [sum(w[r][head * d_h + c] * vals[g][key][c] for c in range(d_h)) for r in range(d)]

    o = [0.0 if bias is None else float(bias[r]) for r in range(d)]
    for head in range(n_h):
        for key in range(t):
            vk = vtilde(head, key)
            for r in range(d):
                o[r] += p[head][i][key] * vk[r]
    norm2 = sum(x * x for x in o)
    term = [p[h][i][j] * x for x in vtilde(h, j)]
    return 0.0 if norm2 == 0 else sum(x * y for x, y in zip(o, term, strict=True)) / norm2


# ---- aggregates (method §3), with loops --------------------------------------------------------
def token_scores(w: Tensor) -> Tensor:
    """``(H, T)`` for one layer ``(H, T, T)``: mean over i ≥ j of w_ij."""
    n_h, t, _ = w.shape
    out = torch.zeros(n_h, t, dtype=F64)
    for h in range(n_h):
        for j in range(t):
            out[h, j] = sum(float(w[h, i, j]) for i in range(j, t)) / (t - j)
    return out


def first_token_weight(w_norm: Tensor) -> float:
    """One layer ``(H, T, T)`` of normalised weights: (1/T) Σ_i Σ_h w_i0."""
    n_h, t, _ = w_norm.shape
    return sum(float(w_norm[h, i, 0]) for h in range(n_h) for i in range(t)) / t


def entropy(w: Tensor, exclude_first: bool = False) -> Tensor:
    """``(H,)`` for one layer: mean over queries of −Σ_j c̄ log c̄, c̄ = |w_ij| / Σ_k |w_ik|.

    Without token 0, keys j ≥ 1 are renormalised and query 0 (no key left) is dropped.
    A query whose weights are all zero has entropy 0.
    """
    n_h, t, _ = w.shape
    first = 1 if exclude_first else 0
    out = torch.zeros(n_h, dtype=F64)
    for h in range(n_h):
        total = 0.0
        for i in range(first, t):
            row = [abs(float(w[h, i, j])) for j in range(first, t)]
            s = sum(row)
            total += 0.0 if s == 0 else -sum(x / s * math.log(x / s) for x in row if x > 0)
        out[h] = total / (t - first)
    return out


def normalise(w: Tensor, measure: str) -> Tensor:
    """``(H, T, T)`` scaled per query so the weights sum to one over (h, j) (method §3)."""
    n_h = w.shape[0]
    w = w.to(F64)
    if measure in ("attention", "intra"):
        return w / n_h
    if measure in ("contribution", "distance"):
        return w.clone()
    out = torch.zeros_like(w)
    for i in range(w.shape[1]):
        s = float(w[:, i, :].sum())
        if s != 0:
            out[:, i, :] = w[:, i, :] / s
    return out


# ---- getting α, v, W_O and o out of an eager model with plain hooks ---------------------------
@dataclass(frozen=True)
class _Layout:
    layers: str  # dotted path to the decoder layers
    attention: str  # attribute of a decoder layer holding the attention module
    projection: str  # attribute of the attention module holding the output projection
    conv1d: bool  # GPT-2 Conv1D: weight stored (in, out)
    value_source: str  # module whose output holds the values
    values: Callable[[Tensor, Any], Tensor]  # module output (B, T, k), config -> (B, G, T, d_h)


def _head_dim(cfg: Any) -> int:
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def _kv_heads(cfg: Any) -> int:
    return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)


def _from_v_proj(out: Tensor, cfg: Any) -> Tensor:
    b, t, _ = out.shape
    return out.view(b, t, _kv_heads(cfg), _head_dim(cfg)).transpose(1, 2)


def _from_phi3(out: Tensor, cfg: Any) -> Tensor:
    q = cfg.num_attention_heads * _head_dim(cfg)
    k = _kv_heads(cfg) * _head_dim(cfg)
    return _from_v_proj(out[..., q + k :], cfg)


def _from_gpt2(out: Tensor, cfg: Any) -> Tensor:
    b, t, _ = out.shape
    v = out[..., 2 * cfg.n_embd :]
    return v.view(b, t, cfg.n_head, cfg.n_embd // cfg.n_head).transpose(1, 2)


def _from_neox(out: Tensor, cfg: Any) -> Tensor:
    b, t, _ = out.shape
    d_h = cfg.hidden_size // cfg.num_attention_heads
    per_head = out.view(b, t, cfg.num_attention_heads, 3 * d_h)
    return per_head[..., 2 * d_h :].transpose(1, 2)


_DEFAULT = _Layout("model.layers", "self_attn", "o_proj", False, "v_proj", _from_v_proj)
LAYOUTS: dict[str, _Layout] = {
    "phi3": _Layout("model.layers", "self_attn", "o_proj", False, "qkv_proj", _from_phi3),
    "gpt2": _Layout("transformer.h", "attn", "c_proj", True, "c_attn", _from_gpt2),
    "gpt_neox": _Layout(
        "gpt_neox.layers", "attention", "dense", False, "query_key_value", _from_neox
    ),
}


def layout(model_type: str) -> _Layout:
    return LAYOUTS.get(model_type, _DEFAULT)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    lay = layout(model.config.model_type)
    obj: Any = model
    for part in lay.layers.split("."):
        obj = getattr(obj, part)
    return [getattr(layer, lay.attention) for layer in obj]


def output_projection(model: nn.Module, layer: int) -> nn.Module:
    return getattr(attention_modules(model)[layer], layout(model.config.model_type).projection)


def output_weight(model: nn.Module, layer: int) -> tuple[Tensor, Tensor | None]:
    """The output projection as a linear map ``(d, H*d_h)`` and its bias."""
    proj = output_projection(model, layer)
    weight = proj.weight.detach()
    if layout(model.config.model_type).conv1d:
        weight = weight.t()
    bias = proj.bias.detach() if getattr(proj, "bias", None) is not None else None
    return weight, bias


@dataclass
class EagerRun:
    """What the eager model computed, per layer: α, v, W_O, b_O and o (hooked)."""

    logits: Tensor  # (B, T, vocab)
    probs: list[Tensor]  # (B, H, T, T) per layer
    values: list[Tensor]  # (B, G, T, d_h)
    weights: list[Tensor]  # (d, H*d_h)
    biases: list[Tensor | None]
    outputs: list[Tensor]  # (B, T, d): the output projection's output

    def layer(self, layer: int, batch: int, valid: Tensor) -> dict[str, Tensor]:
        return reference_layer(
            self.probs[layer][batch],
            self.values[layer][batch],
            self.weights[layer],
            self.biases[layer],
            valid,
        )


def eager_run(model: nn.Module, input_ids: Tensor) -> EagerRun:
    """Run ``model`` with its own eager attention and plain hooks; restore its setting."""
    cfg = model.config
    lay = layout(cfg.model_type)
    modules = attention_modules(model)
    values: list[Tensor] = [torch.empty(0)] * len(modules)
    outputs: list[Tensor] = [torch.empty(0)] * len(modules)
    handles = []
    for idx, attn in enumerate(modules):

        def on_values(_m: nn.Module, _i: Any, out: Tensor, idx: int = idx) -> None:
            values[idx] = lay.values(out.detach(), cfg)

        def on_output(_m: nn.Module, _i: Any, out: Tensor, idx: int = idx) -> None:
            outputs[idx] = out.detach()

        handles.append(getattr(attn, lay.value_source).register_forward_hook(on_values))
        handles.append(getattr(attn, lay.projection).register_forward_hook(on_output))
    previous = cfg._attn_implementation
    try:
        model.set_attn_implementation("eager")
        with torch.no_grad():
            out = model(input_ids=input_ids, output_attentions=True, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
        model.set_attn_implementation(previous)
    pairs = [output_weight(model, i) for i in range(len(modules))]
    return EagerRun(
        logits=out.logits.detach(),
        probs=[a.detach() for a in out.attentions],
        values=values,
        weights=[w for w, _ in pairs],
        biases=[b for _, b in pairs],
        outputs=outputs,
    )


def eager_logits(model: nn.Module, input_ids: Tensor) -> Tensor:
    """Logits of the model's own eager attention (no hooks, no capture)."""
    previous = model.config._attn_implementation
    try:
        model.set_attn_implementation("eager")
        with torch.no_grad():
            return model(input_ids=input_ids, use_cache=False).logits
    finally:
        model.set_attn_implementation(previous)


def window(model: nn.Module, layer: int) -> int | None:
    """The sliding window of a layer from the config (None: full causal attention)."""
    cfg = model.config
    size = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        return size if types[layer] == "sliding_attention" else None
    if cfg.model_type == "mistral":
        return size
    return None


def allowed(t: int, size: int | None) -> Tensor:
    """``(T, T)`` bool: j ≤ i, and i − j < size under a sliding window."""
    i = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    ok = j <= i
    return ok if size is None else ok & (i - j < size)
