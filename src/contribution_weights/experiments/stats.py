"""Per-layer statistics of value geometry, accumulated sequence by sequence (method §3, §5).

The statistics shared by the geometry analyses: the :class:`Stat` base and
:class:`LayerMeans`, the sink rate (which finds the sink layers) and the sampled points
(both regressions and the joint distributions read them). A statistic only one analysis
needs lives in that analysis' module (:mod:`.geometry.analyses`).

An observer (:class:`~.geometry.run.GeometryAccumulator`) hands every :class:`Stat` one
:class:`BlockView` per layer and block of queries of each sequence (batch of one): the
capture's :class:`~contribution_weights.capture.LayerBlock` read in the statistics'
dtype, its ``LayerTensors`` shared with any other observer of the block. A
stat folds what it needs into per-sequence buffers, then into running totals at
``end_sequence``; nothing of size ``(L, H, T, T)`` is kept, so memory does not grow with
the number of sequences. Each stat round-trips through ``state_dict`` for resumable runs.

Conventions: per-sequence quantities (first-token weight, entropy, alignment, sink
rate) are averaged per layer over sequences with equal weight, then over layers.

Null controls (docs/geometry.md): the sink analyses compare token 0 with random non-sink
tokens, drawn per sequence by :func:`random_tokens` and :func:`control_token` from the
run's seed and the sequence's number (so a run split over processes draws what one
process would), and summarise a permutation null with :func:`permutation_summary`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..capture import LayerBlock
from ..measures import layer as layer_measures
from ..measures.layer import LayerTensors
from ..measures.registry import get_measure
from .sampling import Reservoir

WEIGHT_MEASURES = ("attention", "vw", "contribution")
#: random tokens a permutation null draws per sequence (its resolution: p ≥ 1/(draws + 1))
PERMUTATION_DRAWS = 200
#: the streams of random draws: the control token, the alignment and the cone nulls
CONTROL_STREAM, ALIGNMENT_STREAM, CONE_STREAM = 0, 1, 2
POINT_COLUMNS = ("alpha", "r", "kappa", "c", "vnorm", "layer")
GROUPS = ("all", "first", "tail")


@dataclass
class BlockView:
    """Geometry's reading of a capture block (one layer, queries ``rows``, one sequence).

    It wraps the :class:`~contribution_weights.capture.LayerBlock` every observer is
    shown: :attr:`lt` is that block's ``LayerTensors`` in ``dtype`` (built once per block
    and shared, not rebuilt here), and the quantities the statistics read (α, r, κ, the
    measures) are derived from it once per block.
    """

    block: LayerBlock
    num_tokens: int
    dtype: torch.dtype = torch.float32
    scratch: dict[str, Any] = field(default_factory=dict)  # per layer and sequence
    _weights: dict[str, Tensor] = field(default_factory=dict, repr=False)

    @property
    def layer(self) -> int:
        return self.block.layer_idx

    @property
    def rows(self) -> slice:
        return self.block.rows

    @cached_property
    def lt(self) -> LayerTensors:
        return self.block.tensors(self.dtype)

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
        return layer_measures.relative_norm(self.lt)[0]

    @cached_property
    def kappa(self) -> Tensor:
        return layer_measures.cosine(self.lt)[0]

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


class SinkRate(LayerMeans):
    """Per layer, the mean over heads and queries of α_i0 (used to find sink layers)."""

    columns = ("sink_rate",)

    def observe(self, view: BlockView) -> None:
        self._seq[view.layer, 0] += float(view.alpha[:, :, 0].sum())
        self._seq_n[view.layer, 0] += view.alpha.shape[0] * view.alpha.shape[1]


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


# ---- null controls ---------------------------------------------------------------------------
def _rng(seed: int, unit: int, stream: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed) % 2**63, int(unit), stream]))


def random_tokens(num_tokens: int, count: int, seed: int, unit: int, stream: int) -> np.ndarray:
    """``(count,)`` positions drawn uniformly, with replacement, from the non-sink tokens
    1..T−1 of sequence ``unit`` (empty when T < 2), seeded by ``(seed, unit, stream)``."""
    if num_tokens < 2:
        return np.zeros(0, dtype=np.int64)
    return _rng(seed, unit, stream).integers(1, num_tokens, size=count, dtype=np.int64)


def control_token(num_tokens: int, seed: int, unit: int) -> int | None:
    """The control token of sequence ``unit``: a non-sink position drawn uniformly from
    1..T−2, seeded by ``(seed, unit)`` (1 when T = 2, None when T < 2).

    The last token is left out: only its own query reads its value, and scaling it
    changes no next-token prediction that is scored.
    """
    if num_tokens < 2:
        return None
    if num_tokens == 2:
        return 1
    return int(_rng(seed, unit, CONTROL_STREAM).integers(1, num_tokens - 1))


def permutation_summary(
    statistic: float, draws: np.ndarray, alternative: str = "less"
) -> dict[str, float]:
    """The null's mean and standard deviation over its ``draws`` (the statistic with the
    sink replaced by random tokens), and the Monte Carlo p-value
    ``(1 + #{draws at or below the statistic}) / (1 + K)`` (``alternative="less"``; at or
    above for ``"greater"``). NaN draws are left out; NaN when none is left or the
    statistic is NaN.
    """
    if alternative not in ("less", "greater"):
        raise ValueError(f"alternative must be 'less' or 'greater', not {alternative!r}")
    draws = np.asarray(draws, dtype=np.float64)
    draws = draws[~np.isnan(draws)]
    nan = float("nan")
    if draws.size == 0:
        return {"null_mean": nan, "null_sd": nan, "p_value": nan}
    sd = float(draws.std(ddof=1)) if draws.size > 1 else nan
    if np.isnan(statistic):
        p = nan
    else:
        extreme = draws <= statistic if alternative == "less" else draws >= statistic
        p = float((1 + extreme.sum()) / (1 + draws.size))
    return {"null_mean": float(draws.mean()), "null_sd": sd, "p_value": p}
