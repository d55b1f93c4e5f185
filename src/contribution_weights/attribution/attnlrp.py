"""AttnLRP (Achtibat et al., ICML 2024) as gradient × input with the backward rewritten.

AttnLRP's efficient form (lxt 2.1, ``lxt.efficient``) is gradient × input on the input
embeddings, ``R_j = Σ_d (e_j)_d g_jd``, where the gradient ``g`` is taken through a
backward pass whose local rules are replaced so that gradient × input at every layer
implements an LRP rule. The forward values are never changed: each rule is a tensor whose
value is the model's own and whose backward is the rule's (:func:`_regrad`), so the
logits the targets are read from are exactly the model's. The rules, as lxt applies them
to Llama, Qwen and Gemma 3, and how they are carried over here:

* **Linear layers** (projections, embeddings, the LM head, RoPE's rotation, GQA's repeat):
  the plain gradient, which is LRP's ε-rule with ε → 0 in gradient × input (lxt's
  efficient mode). Biases keep their share: ``Σ_in x·g = Σ_out (y − b)·g``.
* **RMSNorm** (every instance: pre-norms, the final norm, Qwen 3 / Gemma 3 q/k norms, Gemma
  2/3 sandwich norms after attention and MLP): the identity rule, implemented by holding
  ``rsqrt(mean(x²) + eps)`` fixed, so the norm is the linear map ``x ↦ s·w'⊙x``. The weight
  convention is found per instance by probing the module with a vector of ones: ``w'`` is
  ``w`` (Llama, Mistral, Qwen) or ``1 + w`` (Gemma 1/2/3, lxt's Gemma 3 patch keeps the
  ``(1 + w)`` outside its patched ``_norm`` too); a norm that matches neither is refused.
  **LayerNorm** (GPT-2, GPT-NeoX): the standard deviation held fixed, the mean subtraction
  differentiated (lxt's ``layer_norm_forward``).
* **Element-wise activations** (SiLU, GELU, GELU-tanh, every activation module of
  ``transformers.activations`` or ``torch.nn``): the identity rule, gradient scaled by
  ``act(x)/x``. lxt divides by ``x + 1e-10``; here ``x == 0`` gives 0 (as lxt does there)
  and no other ``x`` is shifted, which differs from lxt only for ``|x| ≲ 1e-6``.
* **The gate × up product** of gated MLPs (``gate_proj``/``up_proj``, Phi-3's fused
  ``gate_up_proj``): the uniform rule, the gradient halved at the input of ``down_proj``.
* **Attention** (our own eager attention function, registered with transformers'
  ``AttentionInterface`` and switched on only for the call): the products ``q·kᵀ`` and
  ``A·v`` get the uniform rule, so ``v``'s gradient is halved and ``q``'s and ``k``'s
  quartered (the ``A·v`` half times the ``q·kᵀ`` half), as lxt's ``wrap_attention_forward``
  does. The softmax gets no rule of its own: its plain gradient × input is AttnLRP's softmax
  rule ``R_x = x ⊙ (R_A − A Σ R_A)`` (the paper's Prop. 3.1; lxt.efficient leaves softmax
  unpatched for this reason). GQA's shared keys and values sum their heads' gradients;
  sliding windows and padding come in through the additive mask, which adds constants and
  so moves no relevance. Attention sinks (``s_aux``) are refused.
* **Soft-capping** (Gemma 2's attention logits and final logits, not covered by lxt):
  ``c·tanh(x/c)`` is an element-wise non-linearity, so it gets the identity rule like the
  activations (lxt would leave the plain gradient of tanh there). The final soft-cap is
  applied here after the LM head, as the model's forward does, which is why the logits
  are computed from the decoder's last hidden state rather than by the model's forward.

What is explained: the target's value from :func:`~.targets.target_values`. For ``logit``
the backward starts at ``z_t`` (lxt's native output); for ``contrast`` at ``z_t − z_f``;
for ``logprob`` at ``log_softmax(z)_t``, whose gradient weights the logits by
``δ_vt − P_v``, so the scores are AttnLRP of ``z_t − Σ_v P_v z_v`` with ``P`` held fixed.

Conservation. Every rule above passes ``Σ x·g`` on unchanged except three: a bias ``b``
keeps ``Σ b·g`` (and an added position embedding ``p``, GPT-2's, keeps ``Σ p·g``); each
softmax row keeps ``½(Σ A·g_A − Σ x·g_x)`` (the softmax rule is not conservative). So, to
rounding, ``Σ_j R_j = f₀ − Σ biases − Σ softmax leaks`` with ``f₀`` the value the backward
starts from (``z_t``, ``z_t − z_f`` or ``z_t − Σ P_v z_v``); :func:`attnlrp` with ``audit``
collects the two leak terms so the tests check exactly this.

Cost per call: one forward and one backward per target (the forward is shared by a
continuation's targets). Gradients are taken with respect to the embeddings only; the
hooks and the attention implementation are removed in ``finally``; eval mode throughout.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from ..families import UnsupportedModelError
from ..loading import LoadedModel
from .gradients import _check, _embeds, _eval_mode, _ids_1d, _stack
from .targets import Target, target_values

ATTN_IMPLEMENTATION = "contribution_weights_attnlrp"

# the leak terms of the running call, where it is audited (see the module docstring)
_AUDIT: contextvars.ContextVar[list[Tensor] | None] = contextvars.ContextVar(
    "contribution_weights_attnlrp_audit", default=None
)
_registered = False


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient multiplied by ``factor`` (the uniform rule)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.factor, None


def _scale_grad(x: Tensor, factor: float) -> Tensor:
    out: Tensor = _ScaleGrad.apply(x, factor)
    return out


def _regrad(value: Tensor, surrogate: Tensor) -> Tensor:
    """``value`` exactly, with the gradient of ``surrogate`` (which equals it up to rounding)."""
    return value.detach() + (surrogate - surrogate.detach()).to(value.dtype)


def _up(x: Tensor) -> Tensor:
    """``x`` in float32 where it is half precision (the norms' own compute dtype)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _ratio(y: Tensor, x: Tensor) -> Tensor:
    """``y / x`` (detached), 0 where ``x == 0``: the identity rule's gradient factor."""
    with torch.no_grad():
        return torch.where(x == 0, torch.zeros_like(y), y / torch.where(x == 0, 1, x))


def _identity_rule(y: Tensor, x: Tensor) -> Tensor:
    """``y = f(x)`` element-wise, relevance passed on unchanged: gradient ``f(x)/x``."""
    return _regrad(y, x * _ratio(y, x))


def _record(audit: list[Tensor], term: Tensor) -> None:
    # the hooks that call this run in the backward, maybe on autograd's own thread, so the
    # list is taken from the context at forward time
    audit.append(term.detach().double().sum())


def _attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
    attention_mask: Tensor | None, **kwargs: Any,
) -> tuple[Tensor, None]:  # fmt: skip
    """Eager attention with AttnLRP's rules (see the module docstring); no dropout (eval
    mode); ``scaling`` and ``softcap`` read from ``kwargs`` as transformers passes them."""
    scaling, softcap = kwargs.get("scaling"), kwargs.get("softcap")
    if kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None:
        raise UnsupportedModelError("AttnLRP: learned attention sinks (s_aux) are not supported")
    query, key, value = _scale_grad(query, 0.25), _scale_grad(key, 0.25), _scale_grad(value, 0.5)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # GQA: a linear copy, its heads' gradients summed
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    logits = torch.matmul(query, key.transpose(2, 3)) * scale
    if softcap is not None:
        logits = _identity_rule(torch.tanh(logits / softcap) * softcap, logits)
    if attention_mask is not None:
        logits = logits + attention_mask[..., : key.shape[-2]]
    probs = torch.softmax(_up(logits), dim=-1).to(query.dtype)
    audit = _AUDIT.get()
    if audit is not None and probs.requires_grad:
        x, p = logits.detach().double(), probs.detach().double()

        def leak(grad: Tensor) -> None:
            g = grad.double()
            gx = p * (g - (p * g).sum(-1, keepdim=True))
            # masked entries: p = 0 and gx = 0, so x (the mask's minimum) contributes 0
            _record(audit, 0.5 * ((p * g).sum() - torch.where(p > 0, x * gx, 0).sum()))

        probs.register_hook(leak)
    out = torch.matmul(probs, value)
    return out.transpose(1, 2).contiguous(), None


def _ensure_registered() -> None:
    global _registered
    if not _registered:
        from ..capture import register_attention

        register_attention(ATTN_IMPLEMENTATION, _attention, "eager")
        _registered = True


def _eps(module: nn.Module) -> float:
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, float | int):
            return float(value)
    raise UnsupportedModelError(f"AttnLRP: {type(module).__name__} has no eps attribute")


def _rms_hook(module: nn.Module) -> Any:
    """The RMSNorm rule for ``module``: its weight convention probed on a vector of ones."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, Tensor):
        raise UnsupportedModelError(f"AttnLRP: {type(module).__name__} has no weight to probe")
    eps = _eps(module)
    w = weight.detach().float()
    with torch.no_grad():
        probe = module(torch.ones(w.shape[-1], dtype=weight.dtype, device=weight.device))
        probe = probe.float() * (1.0 + eps) ** 0.5
    errors = [float((probe - c).abs().max()) for c in (w, 1.0 + w)]
    if min(errors) > 1e-2 * (1.0 + float(probe.abs().max())):
        raise UnsupportedModelError(
            f"AttnLRP: {type(module).__name__} is neither w·x/rms(x) nor (1 + w)·x/rms(x)"
        )
    one_plus = errors[1] < errors[0]

    def hook(mod: Any, args: tuple[Any, ...], out: Tensor) -> Tensor:
        x = _up(args[0])
        s = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps).detach()
        scale = _up(mod.weight) + 1.0 if one_plus else _up(mod.weight)
        return _regrad(out, x * s * scale)

    return hook


def _layer_norm_hook(mod: Any, args: tuple[Any, ...], out: Tensor) -> Tensor:
    x = _up(args[0])
    centred = x - x.mean(-1, keepdim=True)
    s = torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + _eps(mod)).detach()
    y = centred * s
    if getattr(mod, "weight", None) is not None:
        y = y * _up(mod.weight)
    return _regrad(out, y)


def _activation_hook(mod: nn.Module, args: tuple[Any, ...], out: Tensor) -> Tensor:
    return _identity_rule(out, args[0])


def _halve_input(mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (_scale_grad(args[0], 0.5), *args[1:])


def _is_activation(module: nn.Module) -> bool:
    where = type(module).__module__
    if isinstance(module, nn.Softmax | nn.Softmin | nn.LogSoftmax | nn.MultiheadAttention):
        return False
    return where == "transformers.activations" or where == "torch.nn.modules.activation"


def _leak_hooks(
    module: nn.Module, input_embeddings: nn.Module, audit: list[Tensor], sources: list[Tensor]
) -> list[Any]:
    """Audit hooks: the share a bias (or an added position embedding) keeps."""
    bias = getattr(module, "bias", None)
    hooks = []
    if isinstance(bias, Tensor) and bias.dim() == 1:

        def on_bias(mod: nn.Module, args: tuple[Any, ...], out: Tensor) -> None:
            if isinstance(out, Tensor) and out.requires_grad and out.shape[-1] == bias.numel():
                b = bias.detach()
                out.register_hook(lambda g: _record(audit, g * b))

        hooks.append(on_bias)
    if isinstance(module, nn.Embedding) and module is not input_embeddings:
        # not on the way to the input embeddings: autograd.grad would never reach it, so
        # the output is kept and differentiated as an input too (see attnlrp)

        def on_embedding(mod: nn.Module, args: tuple[Any, ...], out: Tensor) -> None:
            if out.requires_grad:
                sources.append(out)

        hooks.append(on_embedding)
    return hooks


@contextmanager
def attnlrp_rules(
    model: nn.Module, audit: list[Tensor] | None = None, sources: list[Tensor] | None = None
) -> Iterator[None]:
    """Inside the block, ``model``'s backward follows AttnLRP's rules (forward unchanged);
    with ``audit``, the leak terms of each backward are appended to it, and the outputs of
    added position embeddings to ``sources``. Restores the hooks, attention implementation
    and train/eval mode in ``finally``."""
    _ensure_registered()
    config_owner: Any = model
    config: Any = model.config
    previous = config._attn_implementation
    input_embeddings = model.get_input_embeddings()  # type: ignore[operator]
    token = _AUDIT.set(audit)
    with ExitStack() as stack:
        stack.callback(_AUDIT.reset, token)
        stack.enter_context(_eval_mode(model))
        rules: list[tuple[nn.Module, Any]] = []
        for module in model.modules():
            name = type(module).__name__
            if name.endswith("RMSNorm") or isinstance(module, nn.RMSNorm):
                rules.append((module, _rms_hook(module)))  # probe before any hook is in
            elif isinstance(module, nn.LayerNorm):
                rules.append((module, _layer_norm_hook))
            elif _is_activation(module):
                rules.append((module, _activation_hook))
            down = getattr(module, "down_proj", None)
            gated = hasattr(module, "gate_proj") or hasattr(module, "gate_up_proj")
            if gated and isinstance(down, nn.Module):
                handle = down.register_forward_pre_hook(_halve_input)
                stack.callback(handle.remove)
        for module, hook in rules:
            stack.callback(module.register_forward_hook(hook).remove)
        if audit is not None:
            kept = sources if sources is not None else []
            for module in model.modules():
                for hook in _leak_hooks(module, input_embeddings, audit, kept):
                    stack.callback(module.register_forward_hook(hook).remove)
        config_owner.set_attn_implementation(ATTN_IMPLEMENTATION)
        stack.callback(config_owner.set_attn_implementation, previous)
        if config._attn_implementation != ATTN_IMPLEMENTATION:
            raise UnsupportedModelError(
                f"AttnLRP: {type(model).__name__} does not let its attention implementation be "
                "set (it must use transformers' AttentionInterface)"
            )
        yield


def _logits(model: Any, embeds: Tensor, start: int) -> Tensor:
    """``(1, T − start, V)`` logits from position ``start`` on: the decoder, the LM head and
    the final soft-cap (identity rule) as the model's forward applies them."""
    decoder = getattr(model, model.base_model_prefix)
    hidden = decoder(inputs_embeds=embeds, use_cache=False).last_hidden_state
    logits: Tensor = model.get_output_embeddings()(hidden[:, start:])
    cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    if cap is not None:
        logits = _identity_rule(torch.tanh(logits / cap) * cap, logits)
    return logits


def attnlrp(
    model: LoadedModel,
    ids: Tensor,
    targets: Sequence[Target],
    *,
    audit: list[list[Tensor]] | None = None,
) -> Tensor:
    """``(n, T)``: AttnLRP relevance of each input token for each target (see the module
    docstring). ``audit``: a list that receives, per target, the leak terms of its backward
    (biases, position embeddings, softmax rows), for checking conservation."""
    ids = _ids_1d(ids)
    num_tokens = ids.shape[0]
    _check(targets, num_tokens, "AttnLRP")
    if not targets:
        return _stack([], num_tokens, model)
    embeds = _embeds(model, ids).requires_grad_(True)
    start = min(t.position for t in targets)
    terms: list[Tensor] = []
    sources: list[Tensor] = []
    rows = []
    with attnlrp_rules(model.model, terms if audit is not None else None, sources):
        logits = _logits(model.model, embeds, start)[0]
        values = target_values(logits[[t.position - start for t in targets]], targets)
        for k in range(len(targets)):
            terms.clear()
            grads = torch.autograd.grad(
                values[k], [embeds, *sources], retain_graph=k + 1 < len(targets),
                allow_unused=True,
            )  # fmt: skip
            rows.append((embeds.detach() * grads[0])[0].sum(-1))
            if audit is not None:
                pairs = zip(sources, grads[1:], strict=True)
                extra = [(s.detach() * g).double().sum() for s, g in pairs if g is not None]
                audit.append([*terms, *extra])
    return _stack(rows, num_tokens, model)
