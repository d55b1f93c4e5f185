"""Gradient and ablation baselines for end-to-end attribution, computed with captum.

Each method scores every input token for one or more resolved :class:`Target` s (a token
chosen, quantity ``logprob``, ``logit`` or ``contrast``; a ``flow`` target has no scalar to
differentiate or ablate and is refused). The scalar explained is :func:`target_values` read
from the logits at the target's position, the same definition contribution flow uses, so
the methods are compared on exactly the same number. Scores are ``(n, T)``: row k is target
k, column j input token j. Let ``e_j`` be token j's input embedding (the output of
``get_input_embeddings()``), ``E`` all of them and ``f(E)`` the target's value:

* :func:`integrated_gradients`: ``IG_j = Σ_d (e_j)_d ∫₀¹ ∂f(αE)/∂(e_j)_d dα``, the path
  integral of the gradient from the all-zero embeddings to the input (Sundararajan et al.
  2017). Completeness: ``Σ_j IG_j = f(E) − f(0)`` up to the quadrature error (captum's
  convergence delta). The baseline is the zero vector at the output of the embedding
  layer: in Gemma the ``√d`` normaliser multiplies the embeddings after the lookup (inside
  the embedding module in recent transformers, in the model's forward in older ones), so a
  zero embedding stays zero either way. Position embeddings added after the embedding
  layer (GPT-2) and rotary positions are not part of the baseline: the baseline is "no
  token content", positions kept. Cost per target: ``steps`` forwards and backwards,
  batched ``internal_batch_size`` at a time (all at once by default), plus two forwards
  (captum records the layer's output at the input and at the baseline).
  Caveat, Gemma 2 and 3: their norms after each block (sandwich norms) scale a residual
  far below √eps up by 1/√eps each, so ``f(αE)`` keeps moving as α → 0 (a jump at the
  baseline no quadrature resolves) and completeness fails by O(0.1) at any practical
  ``steps``; Llama-style pre-norm models converge (the tests show both).
* :func:`input_x_gradient`: ``Σ_d (e_j)_d ∂f/∂(e_j)_d``, the first-order Taylor term of
  removing the token's embedding. Cost per target: one forward and one backward.
* :func:`feature_ablation`: ``f(E) − f(E with e_j := 0)``, each token's embedding zeroed in
  turn. The prediction at position p cannot depend on a later token (a causal model), so
  only tokens ``0..p`` are ablated and later tokens score exactly 0; the sequence is still
  run whole, as the model sees it. Cost per target: ``p + 2`` forwards of the whole
  sequence, batched ``perturbations_per_eval`` at a time (chosen from the sequence length
  by default), under ``no_grad``.

Every forward runs in eval mode with ``use_cache=False`` and, where the model's forward
accepts it, ``logits_to_keep`` so only the positions from the target on are projected on
the vocabulary (never the full ``(T, V)`` logits). One captum call per target: a
continuation's targets are explained one after another. Gradients are taken with respect
to the embeddings only (``torch.autograd.grad``): no ``.grad`` is left on the parameters
and the module's train/eval flag is restored afterwards.

Why captum: these are baselines against which our own method (:mod:`.flow`) is judged, so
they should be the reference implementations the literature uses, not our re-derivation;
captum (PyTorch's attribution library) is maintained, tested and has settled conventions
(Gauss-Legendre quadrature for IG, convergence deltas, batched ablations). The tests check
each function against a direct captum call and against hand-written autograd/zeroing.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from captum.attr import FeatureAblation, InputXGradient, LayerIntegratedGradients
from torch import Tensor, nn

from ..loading import LoadedModel
from .targets import Target, TargetError, target_values

# Feature ablation batches this many tokens per forward (perturbations × sequence length)
# when perturbations_per_eval is not given.
ABLATION_BATCH_TOKENS = 8192


class ZeroBaselineEmbedding(nn.Module):
    """The model's input embedding layer, with the id ``-1`` embedding to the zero vector.

    captum's layer integrated gradients computes the baseline's layer activation by
    running the layer on baseline *inputs*, and no token's embedding is zero; this thin
    wrapper gives the zero-embedding baseline an id. For real ids its output is exactly
    the wrapped layer's (the attribution is to the input embedding layer's output).
    """

    BLANK = -1

    def __init__(self, embed: nn.Module) -> None:
        super().__init__()
        self.embed = embed

    def forward(self, ids: Tensor) -> Tensor:
        blank = ids == self.BLANK
        out: Tensor = self.embed(ids.clamp_min(0))
        return out.masked_fill(blank[..., None], 0)


def _check(targets: Sequence[Target], num_tokens: int, method: str) -> None:
    for t in targets:
        if not t.projected:
            raise TargetError(
                f"{method} explains a scalar, and a 'flow' target ({t.describe()}) has none: "
                "pick quantity logprob, logit or contrast, or use contribution flow for a "
                "pure flow"
            )
        if t.token is None:
            raise TargetError(
                f"{method} needs resolved targets: resolve() the targets' tokens (the "
                "model's top prediction) before explaining them"
            )
        if not 0 <= t.position < num_tokens:
            raise TargetError(
                f"target position {t.position} is out of range for {num_tokens} tokens"
            )


def _ids_1d(ids: Tensor) -> Tensor:
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(
            f"ids must be one sequence of token ids, shape (T,); got {tuple(ids.shape)}"
        )
    return ids


def _logits_kwargs(model: LoadedModel, position: int, num_tokens: int) -> dict[str, Any]:
    """``logits_to_keep``: the positions from ``position`` to the end (where accepted)."""
    params = inspect.signature(model.model.forward).parameters
    return {"logits_to_keep": num_tokens - position} if "logits_to_keep" in params else {}


def _value_fn(model: LoadedModel, target: Target, num_tokens: int) -> Callable[[Tensor], Tensor]:
    """``f(inputs_embeds (B, T, d)) -> (B,)``: the target's value for each sequence."""
    kwargs = _logits_kwargs(model, target.position, num_tokens)

    def value(embeds: Tensor) -> Tensor:
        logits = model.model(inputs_embeds=embeds, use_cache=False, **kwargs).logits
        # with logits_to_keep the last T - position rows are kept; without it, all T
        rows = logits[:, target.position - num_tokens]
        return target_values(rows, [target] * rows.shape[0]).to(rows.device)

    return value


def _out_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _stack(rows: list[Tensor], num_tokens: int, model: LoadedModel) -> Tensor:
    if not rows:
        return torch.zeros(0, num_tokens, dtype=_out_dtype(model.model.dtype), device=model.device)
    return torch.stack(rows).to(_out_dtype(rows[0].dtype))


@contextmanager
def _eval_mode(module: nn.Module) -> Iterator[None]:
    was = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was)


def _embeds(model: LoadedModel, ids: Tensor) -> Tensor:
    with torch.no_grad():
        out: Tensor = model.model.get_input_embeddings()(ids[None].to(model.device))
    return out.detach()


def integrated_gradients(
    model: LoadedModel,
    ids: Tensor,
    targets: Sequence[Target],
    *,
    steps: int = 50,
    internal_batch_size: int | None = None,
) -> Tensor:
    """``(n, T)``: integrated gradients of each target from the zero-embedding baseline,
    summed over the embedding dimensions (captum ``LayerIntegratedGradients`` on the input
    embedding layer, Gauss-Legendre quadrature with ``steps`` points)."""
    ids = _ids_1d(ids)
    num_tokens = ids.shape[0]
    _check(targets, num_tokens, "integrated gradients")
    layer = ZeroBaselineEmbedding(model.model.get_input_embeddings())
    inputs = ids[None].to(model.device)
    baseline = torch.full_like(inputs, ZeroBaselineEmbedding.BLANK)
    rows = []
    with _eval_mode(model.model):
        for target in targets:
            value = _value_fn(model, target, num_tokens)

            def forward(tokens: Tensor, value: Callable[[Tensor], Tensor] = value) -> Tensor:
                return value(layer(tokens))

            lig = LayerIntegratedGradients(forward, layer)
            attr = lig.attribute(
                inputs,
                baselines=baseline,
                n_steps=steps,
                internal_batch_size=internal_batch_size,
            )
            rows.append(attr[0].sum(-1))
    return _stack(rows, ids.shape[0], model)


def input_x_gradient(model: LoadedModel, ids: Tensor, targets: Sequence[Target]) -> Tensor:
    """``(n, T)``: each token's embedding times the target's gradient with respect to it,
    summed over the embedding dimensions (captum ``InputXGradient`` on ``inputs_embeds``)."""
    ids = _ids_1d(ids)
    num_tokens = ids.shape[0]
    _check(targets, num_tokens, "input × gradient")
    embeds = _embeds(model, ids)
    rows = []
    with _eval_mode(model.model):
        for target in targets:
            ixg = InputXGradient(_value_fn(model, target, num_tokens))
            attr = ixg.attribute(embeds.clone().requires_grad_(True))
            rows.append(attr[0].detach().sum(-1))
    return _stack(rows, ids.shape[0], model)


def feature_ablation(
    model: LoadedModel,
    ids: Tensor,
    targets: Sequence[Target],
    *,
    perturbations_per_eval: int | None = None,
) -> Tensor:
    """``(n, T)``: ``value(input) − value(token j's embedding zeroed)`` for each token j up
    to the target's position (later tokens: 0), with captum ``FeatureAblation`` on
    ``inputs_embeds``, one feature per token. ``perturbations_per_eval``: ablations run
    per forward (default: as many as fit ``ABLATION_BATCH_TOKENS`` tokens)."""
    ids = _ids_1d(ids)
    num_tokens = ids.shape[0]
    _check(targets, num_tokens, "feature ablation")
    embeds = _embeds(model, ids)
    per_eval = perturbations_per_eval or max(1, ABLATION_BATCH_TOKENS // num_tokens)
    out = torch.zeros(
        len(targets), num_tokens, dtype=_out_dtype(embeds.dtype), device=embeds.device
    )
    with _eval_mode(model.model):
        for k, target in enumerate(targets):
            stop = target.position + 1
            value = _value_fn(model, target, num_tokens)
            suffix = embeds[:, stop:]

            def forward(
                prefix: Tensor,
                value: Callable[[Tensor], Tensor] = value,
                suffix: Tensor = suffix,
            ) -> Tensor:
                # the later tokens are held fixed: they cannot change the prediction
                rest = suffix.expand(prefix.shape[0], -1, -1)
                return value(torch.cat([prefix, rest], dim=1))

            mask = torch.arange(stop, device=embeds.device)[None, :, None]
            attr = FeatureAblation(forward).attribute(
                embeds[:, :stop],
                baselines=0.0,
                feature_mask=mask,
                perturbations_per_eval=min(per_eval, stop),
            )
            out[k, :stop] = attr[0, :, 0].to(out.dtype)
    return out
