"""Running many intervention configurations as batched forward passes.

:func:`intervened_logprobs` runs rows of token ids under any
:class:`~..capture.Intervention` (batch dimension = configurations) and returns the
log-probability of every next token; :func:`token_logprobs` is it with one
:class:`~..interventions.Removal` per row, and :func:`mean_nll` turns the result into a
per-row mean NLL. Rows are chunked automatically: the chunk size is estimated from the
model's shapes against a memory budget, and halved again whenever the device still
reports that it is out of memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager

import torch
from torch import Tensor

from ..capture import Intervention, capturing, check_all_layers_seen
from ..interventions import Removal, SequentialRemoval, tracking_sinks
from ..loading import LoadedModel

DEFAULT_MEMORY_BYTES = 3 * 1024**3


def row_bytes(model: LoadedModel, num_tokens: int) -> int:
    """Rough peak memory of one batch row of a removal forward (bytes)."""
    cfg = model.text_config
    d = int(cfg.hidden_size)
    inter = int(getattr(cfg, "intermediate_size", 4 * d) or 4 * d)
    vocab = int(cfg.vocab_size)
    heads = model.num_heads
    t = num_tokens
    per_token = 4 * (3 * vocab + 24 * d + 4 * inter)  # logits + log-softmax, activations
    attention = 4 * heads * t * t * 10  # probs and measure intermediates of one layer
    return per_token * t + attention


def auto_batch_size(model: LoadedModel, num_tokens: int, memory_bytes: int) -> int:
    return max(1, memory_bytes // max(1, row_bytes(model, num_tokens)))


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


#: for rows ``start:stop`` of the batch, a context manager giving their intervention
#: (entered around that chunk's forward, e.g. to hold hooks); None = no intervention
InterventionFor = Callable[[slice], AbstractContextManager[Intervention | None]]


def _forward(
    model: LoadedModel, ids: Tensor, intervention: AbstractContextManager[Intervention | None]
) -> Tensor:
    ids = ids.to(model.device)
    with (
        torch.no_grad(),
        intervention as scale,
        capturing(model.model, intervention=scale) as session,
    ):
        logits = model.model(input_ids=ids, use_cache=False).logits
        check_all_layers_seen(session, model.num_layers)
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
    sink_threshold: float = 0.95,
    batch_size: int | None = None,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
) -> Tensor:
    """``(R, T-1)``: log p(token t+1 | ≤ t) of each row of ``input_ids`` ``(R, T)``.

    Row r runs under ``removals[r]``.

    ``batch_size`` rows run per forward (default: as many as fit ``memory_bytes``);
    results do not depend on it beyond float rounding.
    """
    if input_ids.ndim != 2 or input_ids.shape[0] != len(removals):
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} must be (rows, tokens) with one row per removal "
            f"({len(removals)})"
        )

    @contextmanager
    def removal_for(rows: slice) -> Iterator[Intervention | None]:
        with tracking_sinks(model.model, sink_threshold) as sinks:
            yield SequentialRemoval(
                removals[rows],
                eligible_len=eligible_len,
                sinks=sinks,
                protect_sinks=protect_sinks,
                scope=scope,
            )

    return intervened_logprobs(
        model, input_ids, removal_for, batch_size=batch_size, memory_bytes=memory_bytes
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
) -> Tensor:
    """``(R, T-1)``: log p(token t+1 | ≤ t) of each row of ``input_ids`` ``(R, T)``, rows
    ``start:stop`` running under the intervention ``intervention_for(slice(start, stop))``
    gives (e.g. ``lambda rows: contextlib.nullcontext(MyScale(gammas[rows]))``).

    Chunked as :func:`token_logprobs`: ``batch_size`` rows per forward (default: as many
    as fit ``memory_bytes``), halved on out-of-memory.
    """
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} must be (rows, tokens)")
    if input_ids.shape[1] < 2:
        raise ValueError("a sequence needs at least 2 tokens to be scored")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be at least 1 (or None for automatic), got {batch_size}")
    rows = input_ids.shape[0]
    size = (
        batch_size
        if batch_size is not None
        else auto_batch_size(model, input_ids.shape[1], memory_bytes)
    )
    out = torch.empty(rows, input_ids.shape[1] - 1)
    start = 0
    while start < rows:
        stop = min(rows, start + size)
        try:
            out[start:stop] = _forward(
                model, input_ids[start:stop], intervention_for(slice(start, stop))
            )
        except (RuntimeError, torch.OutOfMemoryError) as err:
            if not _is_oom(err) or size == 1:
                raise
            size = max(1, size // 2)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            continue
        start = stop
    return out
