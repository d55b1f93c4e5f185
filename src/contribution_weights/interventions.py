"""Every intervention, in one place: token removal (method §4), sink-value scaling (method
§5), and running rows of configurations as batched forward passes.

Token removal takes tokens out of attention heads, layer by layer.

Removing token j from head h of layer l multiplies column j of that head's attention by
0 for every query (no renormalisation), i.e. sets the projected value ṽ_j^(l,h) to 0.
It goes through :class:`~.capture.Intervention`: the registered attention function asks
:class:`SequentialRemoval` once per layer for column multipliers ``(B, H, T)``.

Sequential ranking. When layer l is reached its inputs already carry the removals of
layers < l (each batch row runs its own intervened forward), so the measure is computed
on that layer's own, already-affected activations, tokens are ranked by token score per
head (mean over queries i ≥ j, :func:`~.measures.aggregates.token_scores`), the chosen
ones removed, and the pass goes on.

Batch rows are configurations: row b follows ``removals[b]`` (measure, mode, rate; or
no removal), so every configuration of one sequence runs in one forward pass.

Eligibility. Keys ``j < eligible_len`` (the whole sequence for language modelling, the
prompt for downstream tasks) that are not sinks. Sinks at layer l are token 0 and any
token whose layer-input hidden state has cosine > 0.95 with token 0's; they are read by
:func:`tracking_sinks`, forward pre-hooks on the decoder layers that live only inside
its ``with`` block. Token scores average over the queries ``i < eligible_len`` only, so
what follows the prompt never changes which prompt tokens are removed.

Scope. ``"layer"``: per (layer, head), remove the top (comprehensiveness) or bottom
(sufficiency) ⌈p·N_eligible⌉ tokens. ``"global"``: a threshold per configuration, from
the scores of a clean pass (:func:`global_thresholds`); a token is removed from a head
when its current score is above (comprehensiveness) or below (sufficiency) it.

Sink-value scaling. :class:`SinkValueScale` multiplies v_0 by γ_b in the given layers
(batch row b), the paper's Figure 6c.

Running. :func:`intervened_logprobs` runs rows of token ids under any
:class:`~.capture.Intervention` (batch dimension = configurations) and returns the
log-probability of every next token; :func:`token_logprobs` is it with one
:class:`Removal` per row, and :func:`mean_nll` turns the result into a per-row mean NLL.
Rows are chunked automatically: the chunk size is estimated from the model's shapes
against a memory budget, and halved again whenever the device still reports that it
is out of memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from .capture import Intervention, LayerCall, capturing, check_all_layers_seen
from .defaults import MODES, SCOPES, SINK_COSINE  # light: the CLI shows them before torch
from .families import family_for
from .loading import LoadedModel
from .measures.aggregates import later_query_mean, later_query_sums
from .measures.layer import LayerTensors
from .measures.registry import get_measure


@dataclass(frozen=True)
class Removal:
    """What one batch row removes. ``measure=None``: nothing (the clean row).

    ``threshold`` is set for the global scope only (see :func:`global_thresholds`).
    """

    measure: str | None
    mode: str = "comprehensiveness"
    rate: float = 0.0
    threshold: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"removal rate {self.rate} is outside [0, 1]; pass rates like 0.1,0.5")
        if self.measure is not None:
            get_measure(self.measure)


CLEAN = Removal(None)


def column_sums_of(measure: str) -> Callable[[LayerTensors], Tensor] | None:
    """The measure's per-key column sums (:attr:`Measure.column_sums`), the fast path of
    token scores: no ``(n, H, I, T)`` measure tensor or masked copy is built."""
    return get_measure(measure).column_sums


#: (n, H, I, Tk) tensors the token-score maths holds at once, for sizing query blocks
_LIVE_BLOCKS = 6


def removal_count(rate: float, n_eligible: Tensor) -> Tensor:
    """⌈p·N⌉ per row, robust to float noise (0.3·10 is 3, not 4)."""
    return torch.ceil(torch.round(n_eligible.double() * rate, decimals=6)).long()


# ---- sinks -----------------------------------------------------------------------------
def sink_mask(hidden: Tensor, threshold: float = SINK_COSINE) -> Tensor:
    """``(B, T)`` bool: token 0 and tokens whose hidden state has cosine > ``threshold`` with it."""
    h = hidden.float()
    cos = nn.functional.cosine_similarity(h, h[:, :1].expand_as(h), dim=-1)
    mask = cos > threshold
    mask[:, 0] = True
    return mask


@dataclass
class SinkTracker:
    """Sink masks per layer, filled by forward pre-hooks as the forward pass goes."""

    threshold: float = SINK_COSINE
    masks: dict[int, Tensor] = field(default_factory=dict)

    def mask(self, layer: int) -> Tensor:
        if layer not in self.masks:
            raise RuntimeError(
                f"no layer-input hidden state was seen for layer {layer}; the decoder layers "
                "found by the family spec are not the ones the model ran"
            )
        return self.masks[layer]

    def _hook(self, layer: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        self.masks[layer] = sink_mask(hidden.detach(), self.threshold)


@contextmanager
def tracking_sinks(model: nn.Module, threshold: float = SINK_COSINE) -> Iterator[SinkTracker]:
    """Record sink masks from every decoder layer's input; hooks removed in ``finally``."""
    layers = family_for(model.config).decoder_layers(model)
    tracker = SinkTracker(threshold)
    handles = []
    try:
        for idx, layer in enumerate(layers):

            def hook(_m: nn.Module, args: Any, kwargs: Any, idx: int = idx) -> None:
                tracker._hook(idx, args, kwargs)

            handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
        yield tracker
    finally:
        for handle in handles:
            handle.remove()


# ---- the intervention ------------------------------------------------------------------
@dataclass
class LayerRecord:
    """For tests and diagnostics: what one layer saw and removed, per batch row."""

    scores: Tensor  # (B, H, T) token scores (NaN for clean rows)
    removed: Tensor  # (B, H, T) bool
    eligible: Tensor  # (B, T) bool


class SequentialRemoval:
    """An :class:`~.capture.Intervention` removing tokens per batch row's :class:`Removal`.

    Args:
        removals: one per batch row.
        eligible_len: keys (and scoring queries) are ``< eligible_len``; None = all.
        sinks: the :class:`SinkTracker` of the same forward, or None (only token 0 is
            then protected when ``protect_sinks``).
        protect_sinks: sinks are not eligible (method §4); False makes them eligible.
        scope: ``"layer"`` or ``"global"`` (then every removing row needs a threshold).
        compute_dtype: dtype of the measure maths.
        block_bytes: memory bound for one block of query rows of measure intermediates.
        keep_history: keep a :class:`LayerRecord` per layer in :attr:`history`.
    """

    def __init__(
        self,
        removals: Sequence[Removal],
        *,
        eligible_len: int | None = None,
        sinks: SinkTracker | None = None,
        protect_sinks: bool = True,
        scope: str = "layer",
        compute_dtype: torch.dtype = torch.float32,
        block_bytes: int = 256 * 1024**2,
        keep_history: bool = False,
    ) -> None:
        if scope not in SCOPES:
            raise ValueError(f"unknown scope {scope!r}; choose one of {', '.join(SCOPES)}")
        if scope == "global" and any(r.measure and r.threshold is None for r in removals):
            raise ValueError("global scope needs a threshold per removal (global_thresholds)")
        self.removals = list(removals)
        self.eligible_len = eligible_len
        self.sinks = sinks
        self.protect_sinks = protect_sinks
        self.scope = scope
        self.compute_dtype = compute_dtype
        self.block_bytes = block_bytes
        self.keep_history = keep_history
        self.history: dict[int, LayerRecord] = {}

    def eligible(self, call: LayerCall) -> Tensor:
        b, t = call.batch, call.k_len
        limit = t if self.eligible_len is None else min(t, self.eligible_len)
        ok = (torch.arange(t, device=call.query.device) < limit).expand(b, t).clone()
        if self.protect_sinks:
            if self.sinks is not None:
                ok &= ~self.sinks.mask(call.layer_idx).to(ok.device)[:, :t]
            ok[:, 0] = False
        return ok

    def token_scores(self, call: LayerCall, rows: Sequence[int], measure: str) -> Tensor:
        """``(len(rows), H, T)``: s_j = mean over scoring queries i ≥ j of the measure."""
        idx = torch.tensor(list(rows), device=call.query.device)
        h, t = call.num_heads, call.k_len
        limit = t if self.eligible_len is None else min(t, self.eligible_len)
        dtype = self.compute_dtype
        total = torch.zeros(len(rows), h, t, dtype=dtype, device=call.query.device)
        # bytes per query row: (n, H, Tk) elements of dtype, times the (n, H, I, Tk) tensors
        # the measure maths holds at once (α, ⟨o, ṽ⟩, γ, its masked copy, temporaries)
        per_query = max(1, len(rows) * h * t * (torch.finfo(dtype).bits // 8) * _LIVE_BLOCKS)
        step = max(1, self.block_bytes // per_query)
        compute = get_measure(measure).compute
        # column sums need α_ij = 0 wherever query i may not see key j (j > i included),
        # which the eager mask guarantees; without a mask the generic path masks explicitly
        column_sums = column_sums_of(measure) if call.attention_mask is not None else None
        for start in range(0, limit, step):
            block = slice(start, min(limit, start + step))
            probs = call.probs(block, idx)  # only this measure's batch rows
            lt = call.layer_tensors(block, probs, dtype, batch=idx)
            if column_sums is not None:
                total += column_sums(lt)
            else:
                total += later_query_sums(lt.masked(compute(lt)), start)
        return later_query_mean(total, limit)

    def column_scale(self, call: LayerCall) -> Tensor | None:
        if call.batch != len(self.removals):
            raise ValueError(
                f"the batch has {call.batch} rows but {len(self.removals)} removals were given"
            )
        b, h, t = call.batch, call.num_heads, call.k_len
        eligible = self.eligible(call)
        removed = torch.zeros(b, h, t, dtype=torch.bool, device=eligible.device)
        scores_all = torch.full((b, h, t), float("nan"), device=eligible.device)
        groups: dict[str, list[int]] = {}
        for row, r in enumerate(self.removals):
            if r.measure is not None:
                groups.setdefault(r.measure, []).append(row)
        for measure, rows in groups.items():
            scores = self.token_scores(call, rows, measure)
            scores_all[rows] = scores.float()
            removed[rows] = self._select(scores, eligible[rows], [self.removals[r] for r in rows])
        if self.keep_history:
            self.history[call.layer_idx] = LayerRecord(
                scores_all.cpu(), removed.cpu(), eligible.cpu()
            )
        if not groups:
            return None
        return (~removed).to(call.query.dtype)

    def _select(self, scores: Tensor, eligible: Tensor, removals: list[Removal]) -> Tensor:
        """``(n, H, T)`` bool: which eligible tokens each row removes from each head."""
        n, h, t = scores.shape
        elig = eligible[:, None, :].expand(n, h, t)
        comp = torch.tensor([r.mode == "comprehensiveness" for r in removals], device=scores.device)
        if self.scope == "global":
            thr = torch.tensor([float(r.threshold) for r in removals], dtype=scores.dtype)  # type: ignore[arg-type]
            thr = thr.to(scores.device)[:, None, None]
            above = torch.where(comp[:, None, None], scores > thr, scores < thr)
            return above & elig
        # rank eligible tokens: descending for comprehensiveness, ascending for sufficiency
        key = torch.where(comp[:, None, None], -scores, scores)
        key = torch.where(elig, key, torch.full_like(key, float("inf")))
        order = torch.sort(key, dim=-1, stable=True).indices
        rank = torch.empty_like(order)
        rank.scatter_(-1, order, torch.arange(t, device=order.device).expand(n, h, t))
        rates = torch.tensor([r.rate for r in removals], device=scores.device)
        k = torch.stack(
            [removal_count(float(p), e.sum()) for p, e in zip(rates, eligible, strict=True)]
        )
        return (rank < k.to(rank.device)[:, None, None]) & elig


# ---- global thresholds -----------------------------------------------------------------
def global_thresholds(
    model: nn.Module,
    input_ids: Tensor,
    removals: Sequence[Removal],
    *,
    eligible_len: int | None = None,
    protect_sinks: bool = True,
    sink_cosine: float = SINK_COSINE,
    compute_dtype: torch.dtype = torch.float32,
) -> list[Removal]:
    """Removals with their global threshold, from one clean forward of ``input_ids`` ``(T,)``.

    All (layer, head, eligible token) token scores of each measure in the clean pass are
    pooled; comprehensiveness at rate p uses their (1 − p)-quantile, sufficiency the
    p-quantile. Removal compares strictly (method §4), so at rate 1 tokens scoring the
    extreme itself (the clean minimum, resp. maximum) stay, unlike the layer scope.
    """
    measures = sorted({r.measure for r in removals if r.measure is not None})
    if not measures:
        return list(removals)
    probe = SequentialRemoval(
        [Removal(m, "comprehensiveness", 0.0) for m in measures],
        eligible_len=eligible_len,
        protect_sinks=protect_sinks,
        compute_dtype=compute_dtype,
        keep_history=True,
    )
    with torch.no_grad(), tracking_sinks(model, sink_cosine) as sinks:
        probe.sinks = sinks
        with capturing(model, intervention=probe):
            model(input_ids=input_ids[None].expand(len(measures), -1), use_cache=False)
    pooled: dict[str, np.ndarray] = {}
    for i, m in enumerate(measures):
        parts = []
        for rec in probe.history.values():
            s = rec.scores[i]  # (H, T)
            parts.append(s[:, rec.eligible[i]].reshape(-1).double().numpy())
        pooled[m] = np.concatenate(parts) if parts else np.zeros(0)
    out = []
    for r in removals:
        if r.measure is None:
            out.append(r)
            continue
        values = pooled[r.measure]
        q = 1.0 - r.rate if r.mode == "comprehensiveness" else r.rate
        thr = float(np.quantile(values, q)) if values.size else math.inf
        out.append(replace(r, threshold=thr))
    return out


# ---- sink-value scaling -----------------------------------------------------------------
@dataclass
class SinkValueScale:
    """Intervention: attention column 0 times ``gammas[b]`` in ``layers`` (batch item b)."""

    layers: frozenset[int]
    gammas: Tensor  # (B,)

    def column_scale(self, call: LayerCall) -> Tensor | None:
        if call.layer_idx not in self.layers:
            return None
        scale = torch.ones(call.batch, call.num_heads, call.k_len, device=call.query.device)
        scale[:, :, 0] = self.gammas.to(scale.device)[:, None]
        return scale


# ---- running rows of configurations as batched forwards ------------------------------
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
        capturing(model.model, intervention=scale) as session,
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
) -> Tensor:
    """``(R, T-1)``: log p(token t+1 | ≤ t) of each row of ``input_ids`` ``(R, T)``.

    Row r runs under ``removals[r]``. ``last=True`` gives instead ``(R, V)``: the log
    next-token distribution after each row's last token (the output head runs on that
    position only), which scores every one-token continuation at once.

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
        with tracking_sinks(model.model, sink_cosine) as sinks:
            yield SequentialRemoval(
                removals[rows],
                eligible_len=eligible_len,
                sinks=sinks,
                protect_sinks=protect_sinks,
                scope=scope,
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
    "CLEAN",
    "DEFAULT_MEMORY_BYTES",
    "MODES",
    "SCOPES",
    "LayerRecord",
    "Removal",
    "SequentialRemoval",
    "SinkTracker",
    "SinkValueScale",
    "auto_batch_size",
    "global_thresholds",
    "intervened_logprobs",
    "mean_nll",
    "removal_count",
    "sink_mask",
    "token_logprobs",
    "tracking_sinks",
]
