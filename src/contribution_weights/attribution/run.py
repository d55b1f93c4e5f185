"""``attribute``: which input tokens drove a prediction, by one or several methods."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from ..inputs import encode, token_strings
from ..loading import LoadedModel
from ..registry import import_if_present
from .flow import extract_routes, forward_factors, propagate
from .methods import METHODS
from .options import AttributeOptions
from .result import Attribution, Edge, Routes
from .targets import Target, TargetError, resolve, target_values, targets_for

_DTYPES = {"float32": torch.float32, "float64": torch.float64}
#: tokens per batch of integrated gradients' interpolation steps (forward and backward)
IG_BATCH_TOKENS = 4096


@dataclass
class MethodOutput:
    """What one method returns: ``scores`` ``(n, T)`` and, where it decomposes a value,
    that value and the remainder no token receives."""

    scores: Tensor
    explained: Tensor | None = None
    remainder: Tensor | None = None
    logits: Tensor | None = None  # (n, V) at the target positions, where the method ran them


MethodFunction = Callable[[LoadedModel, Tensor, list[Target], AttributeOptions], MethodOutput]


def _pad(scores: Tensor, length: int) -> Tensor:
    """Scores over the first T' positions, padded with zeros to all ``length`` tokens
    (no token after the last target can drive it)."""
    if scores.shape[1] == length:
        return scores
    out = scores.new_zeros(scores.shape[0], length)
    out[:, : scores.shape[1]] = scores
    return out


def _flow_rule(rule: str) -> MethodFunction:
    def run(
        model: LoadedModel, ids: Tensor, targets: list[Target], options: AttributeOptions
    ) -> MethodOutput:
        dtype = _DTYPES[options.compute_dtype]
        if rule == "direct":
            _scalar_only(targets, "the direct method")
        elif rule != "flow":  # pure flows: the position's final state, whatever the token
            targets = [replace(t, quantity="flow", foil=None) for t in targets]
        fwd, resolved = forward_factors(
            model, ids, targets, dtype=dtype, keep_states=rule == "alti"
        )
        out = propagate(model, fwd, resolved, rule=rule)
        return MethodOutput(
            _pad(out.scores, ids.numel()), out.explained, out.remainder, logits=fwd.logits
        )

    return run


flow_method = _flow_rule("flow")
rollout_method = _flow_rule("rollout")
alti_method = _flow_rule("alti")
direct_method = _flow_rule("direct")


def value_zeroing_method(
    model: LoadedModel, ids: Tensor, targets: list[Target], options: AttributeOptions
) -> MethodOutput:
    """Value zeroing (Mohebbi et al. 2023), composed as a pure flow (method §7.5)."""
    from .value_zeroing import value_zeroing

    positions = torch.tensor([t.position for t in targets], dtype=torch.long)
    scores = value_zeroing(model, ids, positions, dtype=_DTYPES[options.compute_dtype])
    explained = torch.full((len(targets),), float("nan"), dtype=torch.float64)
    remainder = 1.0 - scores.double().sum(-1).cpu()
    return MethodOutput(_pad(scores, ids.numel()), explained, remainder)


def _scalar_only(targets: list[Target], name: str) -> None:
    if any(not t.projected for t in targets):
        raise TargetError(
            f"{name} explains a scalar; a pure flow target has none: pick --quantity "
            "logprob, logit or contrast"
        )


def integrated_gradients_method(
    model: LoadedModel, ids: Tensor, targets: list[Target], options: AttributeOptions
) -> MethodOutput:
    from .gradients import integrated_gradients

    _scalar_only(targets, "integrated gradients")
    # the interpolation steps go through the model in batches of about IG_BATCH_TOKENS
    # tokens: all 50 steps of a 512-token text in one batch need over 20 GB on a CPU
    batch = max(1, IG_BATCH_TOKENS // max(1, ids.numel()))
    return MethodOutput(
        integrated_gradients(
            model, ids, targets, steps=options.steps, internal_batch_size=min(batch, options.steps)
        )
    )


def input_x_gradient_method(
    model: LoadedModel, ids: Tensor, targets: list[Target], options: AttributeOptions
) -> MethodOutput:
    from .gradients import input_x_gradient

    _scalar_only(targets, "input × gradient")
    return MethodOutput(input_x_gradient(model, ids, targets))


def attnlrp_method(
    model: LoadedModel, ids: Tensor, targets: list[Target], options: AttributeOptions
) -> MethodOutput:
    from .attnlrp import attnlrp

    _scalar_only(targets, "AttnLRP")
    return MethodOutput(attnlrp(model, ids, targets))


def feature_ablation_method(
    model: LoadedModel, ids: Tensor, targets: list[Target], options: AttributeOptions
) -> MethodOutput:
    from .gradients import feature_ablation

    _scalar_only(targets, "feature ablation")
    return MethodOutput(feature_ablation(model, ids, targets))


def magnitude(out: MethodOutput) -> MethodOutput:
    """A method's output as its magnitude twin reports it: ``|scores|``, which decompose
    nothing (no explained value, no remainder)."""
    return MethodOutput(out.scores.abs(), logits=out.logits)


def method_function(name: str) -> MethodFunction:
    """The function of a registered method (imported on first use). Its entry is
    ``"module:function"`` or ``"module.function"``, the module any importable one (a
    user's ``mymethods.py``: ``"mymethods:my_scores"``); a leading dot (``".run:..."``,
    the built-in methods) is relative to this package. A magnitude twin's (``direct_abs``)
    is its method's, with the scores' absolute values."""
    base = METHODS.get(name).absolute_of
    if base:
        signed = method_function(base)

        def absolute(
            model: LoadedModel, ids: Tensor, targets: list[Target], options: AttributeOptions
        ) -> MethodOutput:
            return magnitude(signed(model, ids, targets, options))

        return absolute
    entry = METHODS.get(name).entry
    module, _, func = entry.partition(":") if ":" in entry else entry.rpartition(".")
    fix = "write it as 'module:function' (e.g. 'mymethods:my_scores')"
    if not module:
        raise ValueError(f"attribution method {name!r}: entry {entry!r} names no module; {fix}")
    if not func:
        raise ValueError(f"attribution method {name!r}: entry {entry!r} names no function; {fix}")
    full = f"{__package__}{module}" if module.startswith(".") else module
    where = import_if_present(full)
    if where is None:
        raise ValueError(
            f"attribution method {name!r}: cannot import module {full!r} of its entry "
            f"{entry!r}; it must be importable (installed, or on PYTHONPATH)"
        )
    fn: MethodFunction | None = getattr(where, func, None)
    if not callable(fn):
        raise ValueError(
            f"attribution method {name!r}: module {full!r} has no function {func!r} "
            f"(entry {entry!r})"
        )
    return fn


def token_id(tokenizer: Any, token: int | str, what: str = "token") -> int:
    """A token given as an id or as its text (which must be exactly one token)."""
    if isinstance(token, int):
        return token
    ids = tokenizer(token, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        pieces = [tokenizer.decode([i]) for i in ids]
        raise TargetError(
            f"the {what} {token!r} is {len(ids)} tokens ({pieces!r}), not one; pass a single "
            "token's text (mind the leading space, e.g. ' Paris') or its id"
        )
    return int(ids[0])


def prompt_ids(ids: Tensor, options: AttributeOptions) -> Tensor:
    """The prompt's ids as attributed: its first ``max_tokens`` with ``truncate`` (which the
    options refuse beside a continuation: :func:`targets_of` refuses a too long input)."""
    if options.max_tokens is not None and options.truncate:
        return ids[: options.max_tokens]
    return ids


def targets_of(
    tokenizer: Any,
    ids: Tensor,
    options: AttributeOptions,
    vocab_size: int | None,
    max_positions: int | None = None,
) -> tuple[Tensor, list[Target]]:
    """The ids with the continuation appended, and the checked, unresolved targets: needs
    only the tokenizer (the command line checks a target before the model loads). ``ids``
    is the prompt (:func:`prompt_ids`); prompt and continuation together must fit
    ``options.max_tokens`` (else ``max_positions``, the model's context length)."""
    continuation = None
    if options.continuation is not None:
        cont = (
            tokenizer(options.continuation, add_special_tokens=False)["input_ids"]
            if isinstance(options.continuation, str)
            else options.continuation
        )
        if not cont:
            raise TargetError("the continuation has no tokens: pass some text")
        continuation = [int(i) for i in cont]
        limit = options.max_tokens or max_positions
        total = ids.numel() + len(continuation)
        if limit is not None and total > limit:
            what = "--max-tokens" if options.max_tokens else "the model's context length"
            raise TargetError(
                f"the prompt ({ids.numel()} tokens) and the continuation ({len(continuation)}) "
                f"make {total} tokens, more than {limit} ({what}); a continuation is explained "
                "from the whole prompt before it, so the prompt is never truncated: shorten it"
                + (" or raise --max-tokens" if options.max_tokens else "")
            )
        ids = torch.cat([ids, torch.tensor(continuation, dtype=ids.dtype)])
    token = None if options.token is None else token_id(tokenizer, options.token)
    foil = None if options.foil is None else token_id(tokenizer, options.foil, "foil")
    targets = targets_for(
        ids.numel(),
        position=options.position,
        token=token,
        foil=foil,
        quantity=options.quantity,
        continuation=continuation,
        vocab_size=vocab_size,
    )
    return ids, targets


def prepare(
    model: LoadedModel, text: str | Sequence[int] | Tensor, options: AttributeOptions
) -> tuple[Tensor, list[Target]]:
    """The input ids (continuation appended) and the checked, unresolved targets."""
    if options.continuation is None:
        ids = encode(model, text, options.max_tokens, options.truncate)
    else:  # never truncated: targets_of checks prompt and continuation together
        ids = encode(model, text, sys.maxsize, truncate=False)
    vocab = getattr(model.text_config, "vocab_size", None)
    return targets_of(model.tokenizer, ids, options, vocab, model.max_positions)


def target_logits(model: LoadedModel, ids: Tensor, targets: list[Target]) -> Tensor:
    """``(n, V)`` float32 logits at the target positions, from one forward that computes
    the logits of the positions from the first target on only."""
    positions = torch.tensor([t.position for t in targets])
    first = int(positions.min())
    kwargs: dict[str, Any] = {}
    if model.last_logits_only():  # the forward takes logits_to_keep
        kwargs["logits_to_keep"] = ids.numel() - first
    with torch.no_grad():
        logits = model.model(input_ids=ids[None].to(model.device), use_cache=False, **kwargs)
    rows = logits.logits[0]
    offset = ids.numel() - rows.shape[0]
    return rows[(positions - offset).to(rows.device)].float()


def attribute(
    model: LoadedModel,
    text: str | Sequence[int] | Tensor,
    options: AttributeOptions | None = None,
    *,
    progress: bool | None = None,
    **overrides: Any,
) -> Attribution:
    """Which input tokens drove the prediction(s) asked for, by each method (method §7).

    Args:
        model: a :class:`LoadedModel` (``cw.load_model()``).
        text: the input text (or ids); with ``continuation=``, the prompt.
        options: an :class:`AttributeOptions`, or its fields as keywords: ``position``
            (default the last), ``token`` (text or id; default the model's top
            prediction), ``quantity`` (``"logprob"``, ``"logit"``, ``"contrast"`` with
            ``foil=``, ``"flow"``), ``continuation``, ``methods`` (default ``["direct"]``;
            also a comma string or ``"all"``), ``steps``, ``routes``, ``threshold``,
            ``compute_dtype``, ``max_tokens`` and ``truncate``.

    Returns:
        An :class:`Attribution`: ``result["flow"]`` is ``(n_targets, T)``,
        ``result.top(10)`` the ten strongest tokens, ``result.summary()`` a few lines.
    """
    if "method" in overrides:
        overrides["methods"] = overrides.pop("method")
    if "target" in overrides:
        target = overrides.pop("target")
        if isinstance(target, int):
            overrides["position"] = target
        elif isinstance(target, Target):
            overrides.update(
                position=target.position,
                token=target.token,
                quantity=target.quantity,
                foil=target.foil,
            )
        else:
            raise TargetError(f"target must be a position or a Target, not {type(target).__name__}")
    if options is None:
        options = AttributeOptions(**overrides)
    elif overrides:
        options = options.replace(**overrides)
    ids, targets = prepare(model, text, options)
    scores: dict[str, Tensor] = {}
    explained: dict[str, list[float]] = {}
    remainder: dict[str, list[float]] = {}
    seconds: dict[str, float] = {}
    nan = [float("nan")] * len(targets)
    logits: Tensor | None = None
    # the flows run first: their forward gives the logits that resolve the targets, so no
    # method pays a forward for it; the others get the resolved targets
    # (a magnitude twin after its method, whose scores it then takes as they are)
    order = sorted(
        options.methods,
        key=lambda m: (not METHODS.get(m).reports_logits, bool(METHODS.get(m).absolute_of)),
    )
    for name in order:
        method = METHODS.get(name)
        if method.absolute_of in scores:
            scores[name] = scores[method.absolute_of].abs()
            explained[name], remainder[name] = nan, nan
            seconds[name] = seconds[method.absolute_of]
            continue
        fn = method_function(name)
        if logits is None and method.scalar and not method.reports_logits:
            logits = target_logits(model, ids, targets)
        start = time.perf_counter()
        given = targets if logits is None else resolve(targets, logits)
        out = fn(model, ids, given, options)
        seconds[name] = time.perf_counter() - start
        if logits is None:
            logits = out.logits.float() if out.logits is not None else None
        scores[name] = out.scores.detach().double().cpu()
        explained[name] = nan if out.explained is None else out.explained.double().tolist()
        remainder[name] = nan if out.remainder is None else out.remainder.double().tolist()
    if logits is None:  # a registered method that reports no logits
        logits = target_logits(model, ids, targets)
    targets = resolve(targets, logits)
    values = target_values(logits, targets)
    scores = {m: scores[m] for m in options.methods}
    routes = _routes(model, ids, targets, options) if options.routes else None
    tokens = token_strings(model, ids)
    target_tokens = [_target_text(model, t) for t in targets]
    return Attribution(
        model=model.name,
        tokens=tokens,
        ids=[int(i) for i in ids],
        targets=targets,
        target_tokens=target_tokens,
        values=[float(v) for v in values],
        scores=scores,
        explained=explained,
        remainder=remainder,
        seconds=seconds,
        routes=routes,
    )


def _target_text(model: LoadedModel, target: Target) -> str:
    assert target.token is not None
    text = model.tokenizer.decode([target.token])
    if target.quantity == "contrast" and target.foil is not None:
        # each side quoted, so that a token's leading space shows: ' Berlin' vs ' Paris'
        return f"{text!r} vs {model.tokenizer.decode([target.foil])!r}"
    return str(text)


def _routes(
    model: LoadedModel, ids: Tensor, targets: list[Target], options: AttributeOptions
) -> list[Routes]:
    """Each target position's routes, read from its pure flow (method §7.4)."""
    flows = [replace(t, quantity="flow", foil=None) for t in targets]
    fwd, flows = forward_factors(model, ids, flows, dtype=_DTYPES[options.compute_dtype])
    out = propagate(model, fwd, flows, keep_rows=True)
    routes = []
    for k, t in enumerate(flows):
        cut, edges = extract_routes(fwd, out, k, options.threshold)
        routes.append(
            Routes(k, t.position, cut, [Edge(*e) for e in edges], num_layers=len(fwd.layers))
        )
    return routes
