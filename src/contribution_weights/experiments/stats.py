"""Per-layer statistics of value geometry, accumulated sequence by sequence (method §3, §5).

An observer (:class:`~.geometry.GeometryAccumulator`) hands every :class:`Stat` one
:class:`BlockView` per layer and block of queries of each sequence (batch of one). A
stat folds what it needs into per-sequence buffers, then into running totals at
``end_sequence``; nothing of size ``(L, H, T, T)`` is kept, so memory does not grow with
the number of sequences. Each stat round-trips through ``state_dict`` for resumable runs.

Conventions: per-sequence quantities (first-token weight, entropy, alignment, sink
rate) are averaged per layer over sequences with equal weight, then over layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..measures import layer as M
from ..measures.aggregates import entropy, first_token_weight
from ..measures.layer import LayerTensors, safe_div
from ..measures.registry import get_measure
from .streaming import Moments, Reservoir

WEIGHT_MEASURES = ("attention", "vw", "contribution")
POINT_COLUMNS = ("alpha", "r", "kappa", "c", "vnorm", "layer")
LOG_NAMES = ("log_alpha", "log_r", "log_kappa")
GROUPS = ("all", "first", "tail")


@dataclass
class BlockView:
    """One layer's tensors for a block of queries ``rows`` of a single sequence."""

    layer: int
    rows: slice
    lt: LayerTensors
    num_tokens: int
    scratch: dict[str, Any] = field(default_factory=dict)  # per layer and sequence
    _weights: dict[str, Tensor] = field(default_factory=dict, repr=False)

    @property
    def first_block(self) -> bool:
        return self.rows.start == 0

    @cached_property
    def alpha(self) -> Tensor:  # (H, I, T)
        return self.lt.probs[0]

    def weight(self, measure: str) -> Tensor:
        """``(H, I, T)``: a registered measure of this block (computed once per block)."""
        if measure not in self._weights:
            self._weights[measure] = get_measure(measure).compute(self.lt)[0]
        return self._weights[measure]

    @property
    def contribution(self) -> Tensor:
        return self.weight("contribution")

    @cached_property
    def r(self) -> Tensor:
        return M.relative_norm(self.lt)[0]

    @cached_property
    def kappa(self) -> Tensor:
        return M.cosine(self.lt)[0]

    @cached_property
    def value_norm(self) -> Tensor:  # (H, T)
        return self.lt.value_norm[0]

    @cached_property
    def points(self) -> Tensor:
        """``(H, I, T)`` bool: valid (query, key) pairs of non-degenerate queries."""
        ok = self.lt.valid[0] & ~self.lt.degenerate[0][:, None]
        return ok.expand_as(self.alpha)

    @property
    def projected_values(self) -> Tensor:  # (H, T, d): ṽ_j^(h), cached by LayerTensors
        return self.lt.projected_values[0]

    @cached_property
    def query_index(self) -> Tensor:  # (I,) positions of the block's queries
        return torch.arange(self.rows.start, self.rows.stop, device=self.alpha.device)


class Stat:
    """Base: a statistic fed block by block; subclasses override what they need."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.sequences = 0

    def begin(self, num_tokens: int, unit: int = 0) -> None:
        """A new sequence (number ``unit`` of the run) starts."""

    def observe(self, view: BlockView) -> None:
        raise NotImplementedError

    def end(self) -> None:
        """The sequence ended (all layers observed)."""
        self.sequences += 1

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)

    def merge(self, state: dict[str, Any]) -> None:
        """Fold in the state of the same statistic over other sequences."""
        self.sequences += int(state["sequences"])


class LayerMeans(Stat):
    """Per-layer sums of per-sequence values, for means over sequences."""

    columns: tuple[str, ...] = ()

    def __init__(self, num_layers: int) -> None:
        super().__init__(num_layers)
        k = len(self.columns)
        self.total = np.zeros((num_layers, k))
        self.count = np.zeros((num_layers, k))
        self._seq = np.zeros((num_layers, k))
        self._seq_n = np.zeros((num_layers, k))

    def begin(self, num_tokens: int, unit: int = 0) -> None:
        self._seq[:] = 0
        self._seq_n[:] = 0

    def merge(self, state: dict[str, Any]) -> None:
        super().merge(state)
        self.total = self.total + state["total"]
        self.count = self.count + state["count"]

    def end(self) -> None:
        super().end()
        done = self._seq_n > 0
        self.total[done] += self._seq[done] / self._seq_n[done]
        self.count[done] += 1

    def by_layer(self) -> np.ndarray:
        """``(L, k)`` means over sequences (NaN where no sequence contributed)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.count > 0, self.total / np.maximum(self.count, 1), np.nan)


class FirstTokenWeight(LayerMeans):
    """Table 4: E[w_0^(l)] = (1/T) Σ_i Σ_h w_i0 with the registry's normalised weights
    (method §3), via :func:`~..measures.aggregates.first_token_weight` per block."""

    columns = WEIGHT_MEASURES

    def observe(self, view: BlockView) -> None:
        queries = view.alpha.shape[1]
        for k, measure in enumerate(WEIGHT_MEASURES):
            mean = first_token_weight(view.weight(measure), measure)  # over the block
            self._seq[view.layer, k] += float(mean) * queries
        self._seq_n[view.layer] += queries


class Entropy(LayerMeans):
    """Table 5: mean over heads and queries of the entropy, with and without token 0.

    Uses :func:`~..measures.aggregates.entropy` per block; without token 0, query 0 is
    dropped too (it has no other key), which only the block starting at query 0 holds.
    """

    columns = tuple(f"{m}:{v}" for v in ("all", "excluding_first") for m in WEIGHT_MEASURES)

    def observe(self, view: BlockView) -> None:
        h, queries = view.alpha.shape[:2]
        later = queries - 1 if view.first_block else queries  # queries i ≥ 1
        valid = view.lt.valid[0].expand_as(view.alpha)
        for k, measure in enumerate(WEIGHT_MEASURES):
            w = view.weight(measure)
            w = torch.where(valid, w, torch.zeros((), dtype=w.dtype))
            self._seq[view.layer, k] += float(entropy(w).sum()) * queries
            self._seq_n[view.layer, k] += h * queries
            if later:
                excl = entropy(w, exclude_first=True) if view.first_block else entropy(w[..., 1:])
                self._seq[view.layer, k + len(WEIGHT_MEASURES)] += float(excl.sum()) * later
                self._seq_n[view.layer, k + len(WEIGHT_MEASURES)] += h * later


class SinkRate(LayerMeans):
    """Per layer, the mean over heads and queries of α_i0 (used to find sink layers)."""

    columns = ("sink_rate",)

    def observe(self, view: BlockView) -> None:
        self._seq[view.layer, 0] += float(view.alpha[:, :, 0].sum())
        self._seq_n[view.layer, 0] += view.alpha.shape[0] * view.alpha.shape[1]


def alignment(projected: Tensor) -> tuple[Tensor, Tensor]:
    """Per head ``(H,)``: mean cos(ṽ_0, ṽ_j) over j ≥ 1, and mean cos(ṽ_i, ṽ_j), i ≠ j ≥ 1.

    Zero vectors count as cosine 0. Needs at least 2 (sink/tail) and 3 (tail/tail) tokens;
    otherwise the entry is NaN.
    """
    norm = projected.norm(dim=-1, keepdim=True)
    unit = safe_div(projected, norm)
    h, t, _ = unit.shape
    nan = torch.full((h,), float("nan"), dtype=unit.dtype)
    if t < 2:
        return nan, nan
    tail = unit[:, 1:]
    sink_tail = (tail @ unit[:, 0, :, None]).squeeze(-1).mean(-1)
    n = t - 1
    if n < 2:
        return sink_tail, nan
    total = tail.sum(1)
    pair_sum = total.square().sum(-1) - tail.square().sum((-1, -2))
    return sink_tail, pair_sum / (n * (n - 1))


class SinkAlignment(LayerMeans):
    """Figure 5: per layer, mean over heads of the sink/tail and tail/tail cosines."""

    columns = ("sink_tail", "tail_tail")

    def observe(self, view: BlockView) -> None:
        if not view.first_block:
            return
        sink_tail, tail_tail = alignment(view.projected_values)
        for k, value in enumerate((sink_tail, tail_tail)):
            if not bool(torch.isnan(value).any()):
                self._seq[view.layer, k] += float(value.mean())
                self._seq_n[view.layer, k] += 1


class ComponentPoints(Stat):
    """Uniform samples of (α, r, κ, ĉ, ‖ṽ‖, layer) over all and over j = 0 (Tables 1/3, Fig 7).

    The j ≥ 1 group is the subset of the "all" sample with j ≥ 1 (a uniform sample of that
    group); j = 0 pairs are rare, so they get a reservoir of their own.
    """

    def __init__(self, num_layers: int, cap: int, seed: int = 0) -> None:
        super().__init__(num_layers)
        self.seed = seed
        self.all = Reservoir((*POINT_COLUMNS, "first"), cap, seed)
        self.first = Reservoir(POINT_COLUMNS, cap, seed + 1)

    def begin(self, num_tokens: int, unit: int = 0) -> None:
        self.all.reseed(self.seed, unit)
        self.first.reseed(self.seed + 1, unit)

    def merge(self, state: dict[str, Any]) -> None:
        super().merge(state)
        self.all.merge(state["all"])
        self.first.merge(state["first"])

    def observe(self, view: BlockView) -> None:
        pts = view.points
        vnorm = view.value_norm[:, None, :].expand_as(view.alpha)
        layer = torch.full_like(view.alpha, float(view.layer))
        cols = [view.alpha, view.r, view.kappa, view.contribution, vnorm, layer]
        is_first = torch.zeros_like(view.alpha)
        is_first[:, :, 0] = 1
        self.all.add_masked(pts, [*cols, is_first])
        self.first.add_masked(pts[:, :, 0], [c[:, :, 0] for c in cols])

    def group(self, name: str) -> dict[str, np.ndarray]:
        """Sampled columns of one token group: ``all``, ``first`` (j = 0) or ``tail`` (j ≥ 1)."""
        if name == "first":
            return self.first.to_numpy()
        cols = self.all.to_numpy()
        if name == "tail":
            keep = cols["first"] == 0
            cols = {k: v[keep] for k, v in cols.items()}
        return cols

    def state_dict(self) -> dict[str, Any]:
        return {
            "sequences": self.sequences,
            "all": self.all.state_dict(),
            "first": self.first.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sequences = state["sequences"]
        self.all.load_state_dict(state["all"])
        self.first.load_state_dict(state["first"])


class LogCorrelations(Stat):
    """Table 2: Pearson correlations of log α, log r, log|κ| over every valid pair (exact)."""

    def __init__(self, num_layers: int) -> None:
        super().__init__(num_layers)
        self.moments = {g: Moments(LOG_NAMES) for g in GROUPS}

    def observe(self, view: BlockView) -> None:
        ok = view.points & (view.alpha > 0) & (view.r > 0) & (view.kappa != 0)
        idx = ok.reshape(-1).nonzero().squeeze(1)
        if idx.numel() == 0:
            return
        comps = (view.alpha, view.r, view.kappa.abs())
        logs = torch.stack([c.reshape(-1)[idx].double().log() for c in comps], dim=-1)
        first = (idx % view.alpha.shape[-1]) == 0
        self.moments["all"].add(logs)
        self.moments["first"].add(logs[first])
        self.moments["tail"].add(logs[~first])

    def merge(self, state: dict[str, Any]) -> None:
        super().merge(state)
        for g, m in self.moments.items():
            m.merge(state[g])

    def state_dict(self) -> dict[str, Any]:
        return {"sequences": self.sequences, **{g: m.state_dict() for g, m in self.moments.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sequences = state["sequences"]
        for g, m in self.moments.items():
            m.load_state_dict(state[g])
