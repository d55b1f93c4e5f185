"""Running rows of configurations as batched forward passes.

:func:`intervened_logprobs` runs rows of token ids under any
:class:`~..capture.Intervention` (batch dimension = configurations) and returns the
log-probability of every next token (or, ``last=True``, the whole next-token
distribution after the last position). The intervention is asked for per chunk of rows,
as a context manager (:data:`InterventionFor`) entered around that chunk's forward only,
so whatever it holds (hooks, sink trackers) lives exactly as long as the forward.

:func:`token_logprobs` is it with one :class:`~.removal.Removal` per row (a
:class:`~.removal.SequentialRemoval` with its :func:`~.sinks.tracking_sinks` per chunk),
and :func:`mean_nll` turns either's result into a per-row mean NLL.

Rows are chunked automatically: the chunk size is estimated from the model's shapes
(:func:`row_bytes`) against a memory budget (:func:`auto_batch_size`), and halved again
whenever the device still reports that it is out of memory. Results do not depend on
the chunking beyond float rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager

import torch
from torch import Tensor

from ..capture import Intervention, capturing, check_all_layers_seen
from ..defaults import SINK_COSINE  # light: the CLI shows it before torch
from ..loading import LoadedModel
from .removal import Removal, SequentialRemoval, sequence_salt
from .sinks import tracking_sinks

DEFAULT_MEMORY_BYTES = 3 * 1024**3


def row_bytes(model: LoadedModel, num_tokens: int, logit_positions: int | None = None) -> int:
    """Rough peak memory of one batch row of a removal forward (bytes); the output head's
    logits are counted at ``logit_positions`` positions (default: every token)."""
    cfg = model.text_config
    d = int(cfg.hidden_size)
    inter = int(getattr(cfg, "intermediate_size", 4 * d) or 4 * d)
    vocab = int(cfg.vocab_size)
    heads = model.num_heads
    t = num_tokens
    logits = 4 * 3 * vocab * (t if logit_positions is None else logit_positions)
    per_token = 4 * (24 * d + 4 * inter)  # activations
    attention = 4 * heads * t * t * 10  # probs and measure intermediates of one layer
    return logits + per_token * t + attention


def auto_batch_size(
    model: LoadedModel, num_tokens: int, memory_bytes: int, logit_positions: int | None = None
) -> int:
    """Rows per forward that fit ``memory_bytes`` by :func:`row_bytes` (at least 1)."""
    need = row_bytes(model, num_tokens, logit_positions)
    return max(1, memory_bytes // max(1, need))


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


#: for rows ``start:stop`` of the batch, a context manager giving their intervention
#: (entered around that chunk's forward, e.g. to hold hooks); None = no intervention
InterventionFor = Callable[[slice], AbstractContextManager[Intervention | None]]


def _forward(
    model: LoadedModel,
    ids: Tensor,
    intervention: AbstractContextManager[Intervention | None],
    last: bool = False,
) -> Tensor:
    ids = ids.to(model.device)
    with (
        torch.no_grad(),
        intervention as scale,
        # eager for unchanged batches too: every configuration and the clean text on
        # one arithmetic, so a difference is the intervention's alone
        capturing(model.model, intervention=scale, kernel="eager") as session,
    ):
        keep = model.last_logits_only() if last else {}
        logits = model.model(input_ids=ids, use_cache=False, **keep).logits
        check_all_layers_seen(session, model.num_layers)
    if last:  # the whole next-token distribution after the last position
        return torch.log_softmax(logits[:, -1].float(), dim=-1).cpu()
    out = torch.empty(ids.shape[0], ids.shape[1] - 1, dtype=torch.float32)
    for b in range(ids.shape[0]):  # one row at a time keeps the log-softmax small
        logp = torch.log_softmax(logits[b, :-1].float(), dim=-1)
        out[b] = logp.gather(-1, ids[b, 1:, None]).squeeze(-1).cpu()
    return out


def token_logprobs(
    model: LoadedModel,
    input_ids: Tensor,
    removals: Sequence[Removal],
    *,
    eligible_len: int | None = None,
    protect_sinks: bool = True,
    scope: str = "layer",
    sink_cosine: float = SINK_COSINE,
    batch_size: int | None = None,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    last: bool = False,
    how: str = "value_zero",
    salt: int | None = None,
    fixed_scores: Mapping[str, Tensor] | None = None,
) -> Tensor:
    """``(R, T-1)``: log p(token t+1 | ≤ t) of each row of ``input_ids`` ``(R, T)``.

    Row r runs under ``removals[r]``. ``last=True`` gives instead ``(R, V)``: the log
    next-token distribution after each row's last token (the output head runs on that
    position only), which scores every one-token continuation at once.

    ``batch_size`` rows run per forward (default: as many as fit ``memory_bytes``);
    results do not depend on it beyond float rounding. ``how``: how a removed token leaves
    a head (:class:`~.removal.SequentialRemoval`). ``salt`` seeds the random baselines per
    text (default: a fingerprint of the first row's ids). ``fixed_scores``: the end-to-end
    rankings' token scores, which removals of ``flow``, ``rollout`` or ``alti`` need
    (:func:`~..attribution.flow.end_to_end_scores` of the first row's first
    ``eligible_len`` ids).
    """
    if input_ids.ndim != 2 or input_ids.shape[0] != len(removals):
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} must be (rows, tokens) with one row per removal "
            f"({len(removals)})"
        )

    text_salt = sequence_salt(input_ids[0]) if salt is None else salt

    @contextmanager
    def removal_for(rows: slice) -> Iterator[Intervention | None]:
        with tracking_sinks(model.model, sink_cosine) as sinks:
            yield SequentialRemoval(
                removals[rows],
                eligible_len=eligible_len,
                sinks=sinks,
                protect_sinks=protect_sinks,
                scope=scope,
                how=how,
                salt=text_salt,
                fixed_scores=fixed_scores,
            )

    return intervened_logprobs(
        model, input_ids, removal_for, batch_size=batch_size, memory_bytes=memory_bytes, last=last
    )


def mean_nll(logprobs: Tensor) -> Tensor:
    """``(R,)`` float64 mean next-token NLL of each row of :func:`token_logprobs` output."""
    return (-logprobs.double()).mean(dim=-1)


def intervened_logprobs(
    model: LoadedModel,
    input_ids: Tensor,
    intervention_for: InterventionFor,
    *,
    batch_size: int | None = None,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    last: bool = False,
) -> Tensor:
    """``(R, T-1)``: log p(token t+1 | ≤ t) of each row of ``input_ids`` ``(R, T)``, rows
    ``start:stop`` running under the intervention ``intervention_for(slice(start, stop))``
    gives (e.g. ``lambda rows: contextlib.nullcontext(MyScale(gammas[rows]))``).

    Chunked as :func:`token_logprobs`: ``batch_size`` rows per forward (default: as many
    as fit ``memory_bytes``), halved on out-of-memory. ``last=True``: ``(R, V)``, the log
    next-token distribution after the last position (see :func:`token_logprobs`).
    """
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} must be (rows, tokens)")
    if input_ids.shape[1] < (1 if last else 2):
        need = "a token" if last else "at least 2 tokens"
        raise ValueError(f"a sequence needs {need} to be scored")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be at least 1 (or None for automatic), got {batch_size}")
    rows = input_ids.shape[0]
    size = (
        batch_size
        if batch_size is not None
        else auto_batch_size(model, input_ids.shape[1], memory_bytes, 1 if last else None)
    )
    parts: list[Tensor] = []
    start = 0
    while start < rows:
        stop = min(rows, start + size)
        try:
            parts.append(
                _forward(model, input_ids[start:stop], intervention_for(slice(start, stop)), last)
            )
        except (RuntimeError, torch.OutOfMemoryError) as err:
            if not _is_oom(err) or size == 1:
                raise
            size = max(1, size // 2)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            continue
        start = stop
    if not parts:  # no rows
        width = int(model.text_config.vocab_size) if last else input_ids.shape[1] - 1
        return torch.empty(0, width)
    return torch.cat(parts)


__all__ = [
    "DEFAULT_MEMORY_BYTES",
    "InterventionFor",
    "auto_batch_size",
    "intervened_logprobs",
    "mean_nll",
    "row_bytes",
    "token_logprobs",
]
