"""Token removal: taking tokens out of attention heads, layer by layer (method §4).

Removing token j from head h of layer l multiplies column j of that head's attention by
0 for every query (no renormalisation), i.e. sets the projected value ṽ_j^(l,h) to 0.
It goes through :class:`~..capture.Intervention`: the registered attention function asks
:class:`SequentialRemoval` once per layer for column multipliers ``(B, H, T)``.

Sequential ranking. When layer l is reached its inputs already carry the removals of
layers < l (each batch row runs its own intervened forward), so the measure is computed
on that layer's own, already-affected activations, tokens are ranked by token score per
head (mean over queries i ≥ j, :func:`~..measures.aggregates.token_scores`), the chosen
ones removed, and the pass goes on. Where the measure has per-key column sums
(:func:`column_sums_of`) the scores come from them, without building the measure tensor.

Batch rows are configurations: row b follows ``removals[b]`` (measure, mode, rate; or
no removal, :data:`CLEAN`), so every configuration of one sequence runs in one forward.

Eligibility. Keys ``j < eligible_len`` (the whole sequence for language modelling, the
prompt for downstream tasks) that are not sinks (read from the :class:`~.sinks.SinkTracker`
of the same forward). Token scores average over the queries ``i < eligible_len`` only,
so what follows the prompt never changes which prompt tokens are removed.

Scope. ``"layer"``: per (layer, head), remove the top (comprehensiveness) or bottom
(sufficiency) ⌈p·N_eligible⌉ tokens (:func:`removal_count`). ``"global"``: a threshold
per configuration, from the scores of a clean pass (:func:`global_thresholds`); a token
is removed from a head when its current score is above (comprehensiveness) or below
(sufficiency) it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor, nn

from ..capture import AttentionEdit, LayerBlock, LayerCall, capturing
from ..defaults import (  # light: the CLI shows them before torch
    END_TO_END_RANKINGS,
    INTERVENTIONS,
    MODES,
    SCOPES,
    SINK_COSINE,
)
from ..measures.aggregates import later_query_mean, later_query_sums
from ..measures.layer import LayerTensors
from ..measures.registry import get_measure
from .sinks import SinkTracker, tracking_sinks


# ---- baselines: rankings that read no measure ---------------------------------------------
def baseline_scores(
    name: str,
    call: LayerCall,
    n: int,
    salt: int = 0,
    fixed: Mapping[str, Tensor] | None = None,
) -> Tensor | None:
    """``(n, H, T)`` token scores of a baseline ranking, or None when ``name`` is a measure.

    ``random:SEED``: uniform scores drawn per (layer, head, token) from ``SEED``, the layer
    and ``salt`` (a fingerprint of the sequence, :func:`sequence_salt`), so each layer and
    each text ranks afresh and a run is reproducible; ``recency``: the position, so the
    latest tokens rank as most important; ``flow``, ``rollout``, ``alti``
    (:data:`~...defaults.END_TO_END_RANKINGS`): the text's end-to-end token scores from
    ``fixed`` (computed once on the clean text by the experiment,
    :func:`~..attribution.flow.end_to_end_scores`), the same in
    every layer and head. Baselines rank like measures (the same eligibility, modes, rates
    and scopes) and say how much of a measure's effect any ranking gets.
    """
    h, t = call.num_heads, call.k_len
    device = call.query.device
    if name in END_TO_END_RANKINGS:
        if fixed is None or name not in fixed:
            raise ValueError(
                f"the {name} ranking needs the text's end-to-end scores: pass fixed_scores="
                "attribution.flow.end_to_end_scores(model, ids, names) (faithfulness and "
                "downstream do)"
            )
        scores = torch.zeros(t, device=device, dtype=torch.float32)
        given = fixed[name].to(device, torch.float32)[:t]
        scores[: given.numel()] = given
        return scores.expand(n, h, t).clone()
    if name == "recency":
        return torch.arange(t, device=device, dtype=torch.float32).expand(n, h, t).clone()
    if name.startswith("random:"):
        seed = int(name.partition(":")[2])
        mixed = (seed * 1_000_003 + call.layer_idx * 7_919 + t + salt * 104_729) % (2**63)
        gen = torch.Generator().manual_seed(mixed)
        return torch.rand(h, t, generator=gen).to(device).expand(n, h, t).clone()
    return None


def sequence_salt(ids: Tensor | Sequence[int]) -> int:
    """A stable number from a sequence's token ids, so random baselines differ by text."""
    import hashlib

    values = ids.tolist() if isinstance(ids, Tensor) else list(ids)
    digest = hashlib.sha256(",".join(map(str, values)).encode()).hexdigest()
    return int(digest[:12], 16)


def check_ranking(name: str) -> None:
    """A registered measure, ``recency``, ``random:SEED`` or an end-to-end ranking
    (:data:`~...defaults.END_TO_END_RANKINGS`); else a clear ValueError."""
    if name == "recency" or name in END_TO_END_RANKINGS:
        return
    if name.startswith("random:"):
        seed = name.partition(":")[2]
        if not seed.isdigit():
            raise ValueError(f"random baseline {name!r}: write random:SEED, e.g. random:0")
        return
    get_measure(name)


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
            check_ranking(self.measure)


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
        how: how a removed token leaves a head (:data:`~...defaults.INTERVENTIONS`):
            ``value_zero`` (its projected value set to 0, no renormalisation: the paper's),
            ``key_mask`` (it leaves the softmax; the weights renormalise), ``mean_value``
            (its value replaced by the mean value the query sees).
        salt: a fingerprint of the sequence (:func:`sequence_salt`) for the random
            baselines, so each text gets its own random ranking.
        fixed_scores: the text's end-to-end token scores per ranking name
            (:func:`~..attribution.flow.end_to_end_scores`), for the ``flow``, ``rollout``
            and ``alti`` rankings.
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
        how: str = "value_zero",
        salt: int = 0,
        fixed_scores: Mapping[str, Tensor] | None = None,
    ) -> None:
        if scope not in SCOPES:
            raise ValueError(f"unknown scope {scope!r}; choose one of {', '.join(SCOPES)}")
        if how not in INTERVENTIONS:
            raise ValueError(
                f"unknown intervention {how!r}; choose one of {', '.join(INTERVENTIONS)}"
            )
        self.how = how
        self.salt = salt
        self.fixed_scores = dict(fixed_scores or {})
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
        """``(len(rows), H, T)``: s_j = mean over scoring queries i ≥ j of the measure (a
        baseline's own scores for ``recency`` and ``random:SEED``)."""
        baseline = baseline_scores(measure, call, len(rows), self.salt, self.fixed_scores)
        if baseline is not None:
            return baseline.to(self.compute_dtype)
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
            lt = LayerBlock(call, block, probs, batch=idx).tensors(dtype)
            if column_sums is not None:
                total += column_sums(lt)
            else:
                total += later_query_sums(lt.masked(compute(lt)), start)
        return later_query_mean(total, limit)

    def edit(self, call: LayerCall) -> AttentionEdit | None:
        """The removed tokens of each batch row and head, as :attr:`how` removes them."""
        removed = self.removed(call)
        if removed is None:
            return None
        if self.how == "key_mask":
            return AttentionEdit(masked=removed)
        if self.how == "mean_value":
            return AttentionEdit(replaced=removed)
        return AttentionEdit(scale=(~removed).to(call.query.dtype))

    def removed(self, call: LayerCall) -> Tensor | None:
        """``(B, H, T)`` bool: the tokens each batch row removes from each head of this
        layer (None when no row removes anything)."""
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
        return removed

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
    salt: int | None = None,
    fixed_scores: Mapping[str, Tensor] | None = None,
) -> list[Removal]:
    """Removals with their global threshold, from one clean forward of ``input_ids`` ``(T,)``.

    ``salt`` seeds the random baselines (default: :func:`sequence_salt` of ``input_ids``, as
    :func:`~.batching.token_logprobs` uses for the same sequence); ``fixed_scores`` holds
    the end-to-end rankings' scores (:func:`~..attribution.flow.end_to_end_scores`).

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
        salt=sequence_salt(input_ids) if salt is None else salt,
        fixed_scores=fixed_scores,
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


__all__ = [
    "CLEAN",
    "LayerRecord",
    "Removal",
    "SequentialRemoval",
    "baseline_scores",
    "check_ranking",
    "column_sums_of",
    "global_thresholds",
    "removal_count",
    "sequence_salt",
]
