"""KV-cache eviction methods registered by name, as pure maths on per-layer statistics.

A :class:`Method` maps a :class:`LayerStats` (what one attention layer showed during the
prefill, gathered on the capture path by :mod:`.scoring`) to a ``(B, G, T)`` score per KV
head and cached position; the ``T × (1 − ratio)`` best-scored entries of each KV head are
kept (:mod:`.cache`). Adding a method is one function plus one :func:`register_method`.
A method whose scores depend on the budget (a recent window as a share of it, a first
stage) overrides :meth:`Method.score_for_budget`. Every method keeps exactly the budget:
positions it protects (sinks, a window) are part of it, and when the budget is smaller
than the protected set, the kept ones among them are an arbitrary subset (tied scores).

The baselines follow their papers, in the form kvpress 0.5.5 implements them (window 64,
pooling kernel 5, 4 sink tokens), so ``benchmarks/kvpress_crosscheck.py`` can compare:

* ``streaming_llm`` — Xiao et al. 2023: the first 4 tokens (sinks) plus the most recent ones.
* ``h2o`` — Zhang et al. 2023: attention accumulated over every prefill query.
* ``observed_attention`` — kvpress's form of H2O: the accumulated attention divided by the
  number of queries that can see each key.
* ``snapkv`` — Li et al. 2024: attention of the last ``window`` queries, averaged over them,
  smoothed by a 1-D average pool; the window's own keys are always kept.
* ``tova`` — Oren et al. 2024: the last query's attention averaged over all heads of the
  layer (one kept set per layer); the last key is always kept.
* ``knorm`` — Devoto et al. 2024: low key norm means keep (score = −‖k_j‖).
* ``vatp`` — Guo et al. 2024 (value-aware token pruning): accumulated attention times the
  value's L1 norm, ``S_j · ‖v_j‖₁``.
* ``vatp_sinks`` — ``vatp`` with the first 4 tokens always kept, as the paper runs it.
* ``h2o_recent`` — H2O as its paper runs it: half of the budget the most recent tokens,
  half the heavy hitters by accumulated attention (``recent`` = the recent share).
* ``keydiff`` — Park et al. 2025: −cos(k_j, mean unit key of the head); ``keydiff_sinks``
  the same with the first 4 tokens always kept.
* ``criticalkv`` — Feng et al. 2025 (kvpress's CriticalKVPress) on SnapKV: half the
  budget by SnapKV, the rest by SnapKV × ‖W_O^(h) v_j‖.
* ``expected_attention`` — kvpress's ExpectedAttentionPress: the attention that queries
  drawn from the window's query mean and covariance would pay, times ‖v_j‖; 4 sinks kept.
* ``vatp_wo`` — the same with the norm of the projected value, ``S_j · ‖W_O^(h) v_j‖``
  (the value geometry of method §2, without the alignment term).
* ``window_attention`` — mean attention of the last ``window`` queries, without pooling:
  the attention analogue of ``contribution`` (same window, same heads).
* ``contribution`` — ours: ``|ĉ_ij^(h)|`` summed over the last ``window`` queries and the
  query heads of each KV group; the window's own keys are always kept (as in SnapKV).
* ``contribution_sinks`` — the same, with the first 4 tokens (StreamingLLM's sink set)
  always kept. Evicting a key renormalises the softmax over the rest, unlike the
  faithfulness removal (method §4), which zeroes a column without renormalising: a sink's
  small, anti-aligned ĉ says little about what its eviction does (docs/kv-cache.md). The
  paper's own sink rule (hidden-state cosine > 0.95 with token 0) is not used: in Gemma 3
  it flags almost every token at some layers (508 of 512 at layer 11), so it cannot serve
  as a protected set inside a budget.
* ``renormalised`` — ours: the exact change of each head's output when the key is evicted
  and the softmax renormalises, ``‖Δo_ij^(h)‖ = α_ij ‖o_i^(h) − ṽ_j^(h)‖ / (1 − α_ij)``
  (:mod:`.renormalised`), summed over the last ``window`` queries and the query heads of
  each KV group; the window's own keys are always kept, as for ``contribution``.
* ``renormalised_sinks`` — the same, with the first 4 tokens always kept.
* ``random`` — a seeded uniform draw.
* ``adakv_snapkv``, ``adakv_contribution``, ``adakv_renormalised`` — Feng et al. 2024
  (AdaKV, as kvpress's AdaKVPress) on ``snapkv``, ``contribution`` and ``renormalised``:
  the layer's budget of ``G · n_kept`` entries is shared by its KV heads. Each head first
  keeps its own best ``⌈alpha_safeguard · n_kept⌉`` (0.2 by default, rounded up); the rest
  of the budget goes to the best of all heads' remaining entries compared by the base's
  scores as they are, so heads keep different counts (at least the safeguard each, exactly
  ``G · n_kept`` in all). The base's protected positions (its window, sinks) score above
  every entry of the layer and stay kept. :class:`AdaKV` wraps any base method.

Scores of GQA models are combined over the query heads of a KV group (sum or mean, which
rank alike) because one cached key/value serves the whole group.
"""

# ruff: noqa: F722  (jaxtyping shape strings are not forward references)

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import ClassVar

import torch
from jaxtyping import Float
from torch import Tensor
from torch.nn import functional as F

from ..defaults import KV_WINDOW
from ..registry import Registry

N_SINK = 4
WINDOW = KV_WINDOW  # defaults.py: light, the CLI shows it
KERNEL = 5

Scores = Float[Tensor, "b g t"]


#: what a prefill can gather for the methods (each a field of :class:`LayerStats`); the
#: cached keys and values are always there
STATISTICS = (
    "attn_sum",
    "window_probs",
    "window_contribution",
    "projected_value_norm",
    "window_queries",
    "window_renormalised",
)


@dataclass
class LayerStats:
    """What one attention layer showed during a prefill of ``T`` tokens (see :mod:`.scoring`).

    Attributes:
        keys: ``(B, G, T, d_h)`` cached keys (after RoPE), values ``(B, G, T, d_h)``.
        attn_sum: ``(B, H, T)`` Σ_i α_ij over every prefill query.
        window_probs: ``(B, H, w, T)`` α of the last ``w`` queries (the observation window).
        window_contribution: ``(B, H, T)`` Σ_i |ĉ_ij^(h)| over the last ``w`` queries.
        projected_value_norm: ``(B, H, T)`` ‖W_O^(h) v_j‖.
        window_queries: ``(B, H, w, d_h)`` the last ``w`` queries as the attention saw them
            (after RoPE and any query norm), with ``scaling`` the attention's scale (their
            logits are ``scaling · q_i · k_j``).
        window_renormalised: ``(B, H, T)`` Σ_i ‖Δo_ij^(h)‖ over the last ``w`` queries, the
            exact change of head h's projected output for query i when key j is evicted
            (:func:`~.renormalised.renormalised_effect`).
        seed: for ``random``.
        contribution_by_window: Σ_i |ĉ_ij^(h)| over the last ``n`` queries, for the windows
            ``n`` of methods whose own window is shorter than the observation window.
        renormalised_by_window: Σ_i ‖Δo_ij^(h)‖ over the last ``n`` queries, likewise.

    A statistic no chosen method needs is None (:func:`~.scoring.prefill` skips it).
    """

    keys: Float[Tensor, "b g t dh"]
    values: Float[Tensor, "b g t dh"]
    attn_sum: Float[Tensor, "b h t"] | None = None
    window_probs: Float[Tensor, "b h w t"] | None = None
    window_contribution: Float[Tensor, "b h t"] | None = None
    projected_value_norm: Float[Tensor, "b h t"] | None = None
    window_queries: Float[Tensor, "b h w dh"] | None = None
    window_renormalised: Float[Tensor, "b h t"] | None = None
    scaling: float = 1.0
    seed: int = 0
    window: int = WINDOW
    contribution_by_window: dict[int, Tensor] = field(default_factory=dict)
    renormalised_by_window: dict[int, Tensor] = field(default_factory=dict)

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[1]

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    def per_kv_head(self, x: Float[Tensor, "b h t"], reduce: str = "mean") -> Scores:
        """``(B, H, T)`` → ``(B, G, T)`` over the query heads of each KV group."""
        b, h, t = x.shape
        grouped = x.reshape(b, self.num_kv_heads, h // self.num_kv_heads, t)
        return grouped.sum(2) if reduce == "sum" else grouped.mean(2)

    def need(self, name: str) -> Tensor:
        """A statistic, or a clear error when the prefill did not gather it."""
        value = getattr(self, name)
        if value is None:
            raise ValueError(
                f"the prefill did not gather {name}; prefill with the methods you will "
                "compress by (cw.kv.prefill(model, ids, methods=[...]))"
            )
        return value

    def probs_of_window(self, window: int | None) -> Tensor:
        """``(B, H, w, T)``: α of the last ``window`` queries (None: the whole window)."""
        probs = self.need("window_probs")
        w = self._window(window)
        return probs[:, :, probs.shape[2] - w :]

    def contribution_of_window(self, window: int | None) -> Tensor:
        """``(B, H, T)``: Σ |ĉ| over the last ``window`` queries (None: the whole window)."""
        return self._sum_of_window(
            "window_contribution", self.contribution_by_window, window, "contribution"
        )

    def renormalised_of_window(self, window: int | None) -> Tensor:
        """``(B, H, T)``: Σ ‖Δo‖ over the last ``window`` queries (None: the whole window)."""
        return self._sum_of_window(
            "window_renormalised", self.renormalised_by_window, window, "renormalised effect"
        )

    def _sum_of_window(
        self, name: str, by_window: dict[int, Tensor], window: int | None, what: str
    ) -> Tensor:
        """A window sum: the statistic ``name`` for the whole window, else ``by_window``."""
        w = self._window(window)
        if w == self.window_size:
            return self.need(name)
        if w not in by_window:
            raise ValueError(
                f"the prefill gathered no {what} over the last {w} queries; prefill "
                "with the methods you will compress by (cw.kv.prefill(model, ids, methods=[...]))"
            )
        return by_window[w]

    def queries_of_window(self, window: int | None) -> Tensor:
        """``(B, H, w, d_h)``: the last ``window`` queries (None: the whole window)."""
        queries = self.need("window_queries")
        w = self._window(window)
        return queries[:, :, queries.shape[2] - w :]

    @property
    def window_size(self) -> int:
        """Queries in the observation window (fewer than ``window`` for a short prefill)."""
        return min(self.window, self.length)

    def _window(self, window: int | None) -> int:
        if window is None:
            return self.window_size
        if window > self.window:
            raise ValueError(
                f"a method's window of {window} queries exceeds the prefill's observation "
                f"window of {self.window}; prefill with window={window} or more"
            )
        return min(window, self.length)


# ---- methods -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Method:
    """A named eviction score ``LayerStats -> (B, G, T)``, higher = keep.

    Subclasses add their parameters as fields and override :meth:`score`; ``needs`` names
    the statistics it reads (:data:`STATISTICS`). ``window`` (on methods that look at the
    observation window) is a number of the last prefill queries, None for the prefill's
    whole window.
    """

    name: str
    description: str = ""
    needs: ClassVar[tuple[str, ...]] = ()
    #: whether its KV heads keep different counts: :func:`~.compress` then keeps what
    #: :meth:`kept_mask` says instead of each head's best ``kept`` by score
    head_adaptive: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not isinstance(self.description, str):
            raise TypeError(
                f"method {self.name!r}: description must be text; a score function goes in a "
                "Method subclass's score() (or Method.of(name, function, description))"
            )

    def score(self, stats: LayerStats) -> Scores:
        raise NotImplementedError(f"{type(self).__name__} has no score()")

    def score_for_budget(self, stats: LayerStats, kept: int) -> Scores:
        """The scores when ``kept`` entries per KV head will be kept (:func:`~.compress`
        calls this). Most methods ignore the budget; those that split it (a recent window
        as a share of it, a first selection stage) override this."""
        return self.score(stats)

    def kept_mask(self, stats: LayerStats, kept: int) -> Tensor:
        """``(B, G, T)`` bool, what a head-adaptive method keeps for a budget of ``kept``
        entries per KV head on average (``G · kept`` per layer and batch row)."""
        raise NotImplementedError(f"{type(self).__name__} keeps the same count in every head")

    @property
    def window_queries(self) -> int | None:
        """The observation-window queries it reads (None: the prefill's whole window)."""
        return getattr(self, "window", None)

    @staticmethod
    def of(
        name: str,
        score: Callable[[LayerStats], Tensor],
        description: str = "",
        needs: tuple[str, ...] = STATISTICS,
    ) -> Method:
        """A method from a plain function of the statistics (gathers every statistic
        unless ``needs`` says which it reads)."""
        return _FunctionMethod(name, description, function=score, function_needs=needs)


@dataclass(frozen=True)
class _FunctionMethod(Method):
    function: Callable[[LayerStats], Tensor] | None = None
    function_needs: tuple[str, ...] = STATISTICS

    @property
    def gathers(self) -> tuple[str, ...]:
        return self.function_needs

    def score(self, stats: LayerStats) -> Scores:
        assert self.function is not None
        return self.function(stats)


def method_needs(method: Method) -> tuple[str, ...]:
    """The statistics a method reads (its class's ``needs``, or a function method's own)."""
    return tuple(getattr(method, "gathers", type(method).needs))


METHODS: Registry[Method] = Registry("KV-cache method")


def register_method(method: Method) -> Method:
    """Add (or replace) a method; ``cw kv-eval`` and :func:`~.compress` find it by name."""
    return METHODS.register(method)


def get_method(name: str | Method) -> Method:
    """A registered method by name (a :class:`Method` instance is returned as it is)."""
    return name if isinstance(name, Method) else METHODS.get(name)


def method_names() -> list[str]:
    return METHODS.names()


def resolve_methods(methods: str | Iterable[str] | None) -> list[str]:
    """``"all"``, one name, ``"a,b"`` or a list: checked and deduplicated."""
    return METHODS.resolve(methods)


# ---- helpers -----------------------------------------------------------------------------
def _protect_last(scores: Scores, n: int) -> Scores:
    """Give the last ``n`` positions a score above every other (kept first)."""
    if n <= 0:
        return scores
    out = scores.clone()
    out[..., -n:] = scores.max() + 1
    return out


def _protect_first(scores: Scores, n: int) -> Scores:
    """Give the first ``n`` positions a score above every other, including protected ones."""
    if n <= 0:
        return scores
    out = scores.clone()
    out[..., :n] = scores.max() + 2
    return out


def _window_keys(stats: LayerStats, window: int | None) -> int:
    """Keys of the observation window (all but one position when the prefill is shorter)."""
    return min(stats._window(window), stats.length - 1)


def _window_text(window: int | None) -> str:
    return f"the last {window} queries" if window else "the observation window's queries"


# ---- the methods -------------------------------------------------------------------------
@dataclass(frozen=True)
class StreamingLLM(Method):
    """Xiao et al. 2023: the first ``sinks`` tokens plus the most recent ones."""

    sinks: int = N_SINK

    def score(self, stats: LayerStats) -> Scores:
        t = stats.length
        pos = torch.arange(t, device=stats.keys.device, dtype=torch.float64)
        scores = pos.expand(stats.keys.shape[0], stats.num_kv_heads, t).clone()
        scores[..., : self.sinks] = t + 1.0  # sinks outrank every recent token
        return scores


@dataclass(frozen=True)
class H2O(Method):
    """Zhang et al. 2023: attention accumulated over every prefill query."""

    needs = ("attn_sum",)

    def score(self, stats: LayerStats) -> Scores:
        return stats.per_kv_head(stats.need("attn_sum"))


@dataclass(frozen=True)
class ObservedAttention(Method):
    """kvpress's H2O: accumulated attention / the number of queries that see the key."""

    needs = ("attn_sum",)

    def score(self, stats: LayerStats) -> Scores:
        attn = stats.need("attn_sum")
        t = stats.length
        seen_by = torch.arange(t, 0, -1, device=attn.device, dtype=attn.dtype)
        return stats.per_kv_head(attn / seen_by)


@dataclass(frozen=True)
class SnapKV(Method):
    """Li et al. 2024: the window's attention averaged over its queries, smoothed by an
    average pool of ``kernel``; the window's own keys are always kept."""

    window: int | None = None
    kernel: int = KERNEL
    needs = ("window_probs",)

    def score(self, stats: LayerStats) -> Scores:
        w = _window_keys(stats, self.window)
        probs = stats.probs_of_window(self.window)[:, :, -w:, : stats.length - w]
        scores = probs.mean(dim=-2)
        pad = self.kernel // 2
        scores = F.avg_pool1d(scores, kernel_size=self.kernel, padding=pad, stride=1)
        scores = stats.per_kv_head(scores)
        return F.pad(scores, (0, w), value=float(scores.max()) + 1)


@dataclass(frozen=True)
class TOVA(Method):
    """Oren et al. 2024: the last query's attention averaged over all heads of the layer
    (one kept set per layer); the last key is always kept."""

    needs = ("window_probs",)

    def score(self, stats: LayerStats) -> Scores:
        last = stats.probs_of_window(1)[:, :, -1, :-1].mean(1)  # (B, T-1), every head
        scores = last[:, None].expand(-1, stats.num_kv_heads, -1)
        return F.pad(scores, (0, 1), value=float(scores.max()) + 1)


@dataclass(frozen=True)
class KNorm(Method):
    """Devoto et al. 2024: a low key norm means keep (score = −‖k_j‖)."""

    def score(self, stats: LayerStats) -> Scores:
        return -torch.linalg.vector_norm(stats.keys.float(), dim=-1).to(stats.keys.dtype)


@dataclass(frozen=True)
class H2ORecent(Method):
    """H2O as its paper runs it: the budget split between the most recent tokens and the
    heavy hitters (accumulated attention over every prefill query, group mean).

    Of a budget of ``kept`` entries per KV head, the last ``⌊recent · kept⌋`` positions are
    kept and the other ``kept − ⌊recent · kept⌋`` are the best by accumulated attention
    among the older ones (the paper's 50/50 split by default).
    """

    recent: float = 0.5
    needs = ("attn_sum",)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.recent <= 1:
            raise ValueError(f"method {self.name!r}: recent is a share of the budget in [0, 1]")

    def recent_tokens(self, kept: int) -> int:
        """Positions of the recent window within a budget of ``kept``."""
        return min(kept, int(kept * self.recent))

    def score(self, stats: LayerStats) -> Scores:
        """Without a budget: the scores for keeping half (ratio 0.5)."""
        return self.score_for_budget(stats, max(1, stats.length // 2))

    def score_for_budget(self, stats: LayerStats, kept: int) -> Scores:
        scores = stats.per_kv_head(stats.need("attn_sum"))
        return _protect_last(scores, self.recent_tokens(kept))


@dataclass(frozen=True)
class VATP(Method):
    """Guo et al. 2024: accumulated attention times the value's L1 norm, S_j · ‖v_j‖₁; the
    first ``sinks`` tokens always kept (the paper keeps 4)."""

    sinks: int = 0
    needs = ("attn_sum",)

    def score(self, stats: LayerStats) -> Scores:
        scores = stats.per_kv_head(stats.need("attn_sum")) * stats.values.abs().sum(-1)
        return _protect_first(scores, self.sinks)


@dataclass(frozen=True)
class VATPProjected(Method):
    """VATP with the norm of the projected value, S_j · ‖W_O^(h) v_j‖."""

    needs = ("attn_sum", "projected_value_norm")

    def score(self, stats: LayerStats) -> Scores:
        return stats.per_kv_head(stats.need("attn_sum") * stats.need("projected_value_norm"))


@dataclass(frozen=True)
class WindowAttention(Method):
    """Mean attention of the window's queries, without pooling: contribution's attention
    control (same window, same heads); the window's own keys are always kept."""

    window: int | None = None
    needs = ("window_probs",)

    def score(self, stats: LayerStats) -> Scores:
        scores = stats.per_kv_head(stats.probs_of_window(self.window).mean(2))
        return _protect_last(scores, _window_keys(stats, self.window))


@dataclass(frozen=True)
class Contribution(Method):
    """Ours: |ĉ_ij^(h)| summed over the window's queries and the query heads of each KV
    group; the window's own keys are always kept, and the first ``sinks`` tokens."""

    window: int | None = None
    sinks: int = 0
    needs = ("window_contribution",)

    def score(self, stats: LayerStats) -> Scores:
        scores = stats.per_kv_head(stats.contribution_of_window(self.window), reduce="sum")
        scores = _protect_last(scores, _window_keys(stats, self.window))
        return _protect_first(scores, self.sinks)


@dataclass(frozen=True)
class Renormalised(Method):
    """Ours, exact: Σ over the window's queries and the query heads of each KV group of
    ‖Δo_ij^(h)‖ = α_ij ‖o_i^(h) − ṽ_j^(h)‖ / (1 − α_ij), how far evicting key j moves the
    head's projected output once the softmax renormalises over the rest (contribution
    measures the first-order change without renormalisation). The window's own keys are
    always kept, and the first ``sinks`` tokens."""

    window: int | None = None
    sinks: int = 0
    needs = ("window_renormalised",)

    def score(self, stats: LayerStats) -> Scores:
        scores = stats.per_kv_head(stats.renormalised_of_window(self.window), reduce="sum")
        scores = _protect_last(scores, _window_keys(stats, self.window))
        return _protect_first(scores, self.sinks)


@dataclass(frozen=True)
class KeyDiff(Method):
    """Park et al. 2025: keep the most distinctive keys; score = −cos(k_j, k̄) with k̄ the
    mean of the head's unit keys (kvpress's anchor); the first ``sinks`` tokens always kept
    (the paper keeps none)."""

    sinks: int = 0

    def score(self, stats: LayerStats) -> Scores:
        keys = stats.keys.to(torch.promote_types(stats.keys.dtype, torch.float32))
        anchor = F.normalize(keys, dim=-1).mean(dim=2, keepdim=True)
        return _protect_first(-F.cosine_similarity(keys, anchor, dim=-1), self.sinks)


@dataclass(frozen=True)
class CriticalKV(Method):
    """Feng et al. 2025, as kvpress's CriticalKVPress: two stages on a base method's scores
    ``s_j`` within a budget of ``kept`` per KV head.

    Stage 1 keeps the ``⌊first_stage · kept⌋`` best by ``s_j``; stage 2 fills the rest by
    ``(s_j + epsilon) · ‖W_O^(h) v_j‖`` (the projected value norm, mean over the group's
    heads). kvpress uses the L1 norm of ``W_O^(h) v_j`` (the paper's bound); this uses the
    L2 norm the prefill gathers (``projected_value_norm``).
    """

    base: str | Method = "snapkv"
    first_stage: float = 0.5
    epsilon: float = 1e-4

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.first_stage <= 1:
            raise ValueError(f"method {self.name!r}: first_stage is a share of the budget")

    @property
    def base_method(self) -> Method:
        return get_method(self.base)

    @property
    def gathers(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*method_needs(self.base_method), "projected_value_norm")))

    @property
    def window_queries(self) -> int | None:
        return self.base_method.window_queries

    def score(self, stats: LayerStats) -> Scores:
        """Without a budget: the scores for keeping half (ratio 0.5)."""
        return self.score_for_budget(stats, max(1, stats.length // 2))

    def score_for_budget(self, stats: LayerStats, kept: int) -> Scores:
        base = self.base_method.score_for_budget(stats, kept)
        norm = stats.per_kv_head(stats.need("projected_value_norm"))
        scores = (base + self.epsilon) * norm
        first = min(kept, int(kept * self.first_stage))
        if first > 0:
            top = base.topk(first, dim=-1).indices
            scores = scores.scatter(-1, top, float(scores.max()) + 1)
        return scores


@dataclass(frozen=True)
class AdaKV(Method):
    """Feng et al. 2024 (AdaKV), as kvpress's AdaKVPress: head-adaptive budgets within a
    layer, on any base method's scores.

    The layer keeps ``G · kept`` entries per batch row, shared by its G KV heads. Each head
    first keeps its ``⌈alpha_safeguard · kept⌉`` best entries by the base's scores (the
    safeguard, rounded up: 0.2 of 12 is 3); the rest of the layer's budget goes to the best
    remaining entries of all heads together, compared by the base's scores as they are
    (kvpress's choice: a head whose scores are larger takes more). Positions the base
    protects (its window, sinks) score above every entry of the layer in every registered
    method, so they stay kept whenever the per-head budget holds them. With
    ``alpha_safeguard = 1`` every head keeps exactly its base's own set.
    """

    base: str | Method = "snapkv"
    alpha_safeguard: float = 0.20
    head_adaptive = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.alpha_safeguard <= 1:
            raise ValueError(
                f"method {self.name!r}: alpha_safeguard is a share of each head's budget in [0, 1]"
            )

    @property
    def base_method(self) -> Method:
        return get_method(self.base)

    @property
    def gathers(self) -> tuple[str, ...]:
        return method_needs(self.base_method)

    @property
    def window_queries(self) -> int | None:
        return self.base_method.window_queries

    def safeguard(self, kept: int) -> int:
        """Entries each head keeps at least: ``⌈alpha_safeguard · kept⌉`` (the share taken
        as the decimal it was written, so 0.7 of 10 is 7), at most ``kept``."""
        return min(kept, math.ceil(Fraction(str(self.alpha_safeguard)) * kept))

    def score(self, stats: LayerStats) -> Scores:
        """The base's scores (what the heads compete by)."""
        return self.base_method.score(stats)

    def score_for_budget(self, stats: LayerStats, kept: int) -> Scores:
        return self.base_method.score_for_budget(stats, kept)

    def kept_mask(self, stats: LayerStats, kept: int) -> Tensor:
        scores = self.score_for_budget(stats, kept)
        b, g, t = scores.shape
        kept = min(kept, t)
        safe = self.safeguard(kept)
        keep = torch.zeros(b, g, t, dtype=torch.bool, device=scores.device)
        if safe > 0:
            keep.scatter_(-1, scores.topk(safe, dim=-1).indices, True)
        rest = g * (kept - safe)
        if rest > 0:
            # a score of −∞ stays above every entry already kept (those become −∞ here)
            finite = scores.double().clamp_min(torch.finfo(torch.float64).min)
            free = finite.masked_fill(keep, float("-inf")).reshape(b, g * t)
            keep.view(b, g * t).scatter_(-1, free.topk(rest, dim=-1).indices, True)
        return keep


@dataclass(frozen=True)
class ExpectedAttention(Method):
    """kvpress's ExpectedAttentionPress (Devoto et al. 2025), from the window's queries.

    Future queries of head h are taken as Gaussian with the mean μ and covariance Σ of the
    last ``window`` queries as the attention saw them (after RoPE); the expected logit
    exponent of key j is ``s μ·k_j + s²/2 k_jᵀ Σ k_j`` (``s`` the attention scale), its
    softmax over the keys after the first ``sinks`` is the expected attention, averaged
    over the group, times ``‖v_j‖₂`` (plus ``epsilon``); the first ``sinks`` tokens are
    always kept. kvpress instead takes μ, Σ of every prefill query before RoPE, turned by
    the mean RoPE rotation of the next 512 positions.
    """

    window: int | None = None
    sinks: int = N_SINK
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    needs = ("window_queries",)

    def score(self, stats: LayerStats) -> Scores:
        queries = stats.queries_of_window(self.window)
        dtype = torch.promote_types(queries.dtype, torch.float32)
        q = queries.to(dtype)
        sinks = min(self.sinks, stats.length - 1)
        rep = q.shape[1] // stats.num_kv_heads
        keys = stats.keys[:, :, sinks:].to(dtype).repeat_interleave(rep, dim=1)
        mean = q.mean(dim=2)
        logits = stats.scaling * torch.einsum("bhd,bhtd->bht", mean, keys)
        if self.use_covariance:
            centred = q - mean[:, :, None]
            cov = centred.transpose(-1, -2) @ centred / q.shape[2]
            quad = torch.einsum("bhtd,bhde,bhte->bht", keys, cov, keys)
            logits = logits + stats.scaling**2 / 2 * quad
        scores = stats.per_kv_head(torch.softmax(logits, dim=-1))
        if self.use_vnorm:
            values = stats.values[:, :, sinks:].to(dtype)
            scores = (scores + self.epsilon) * torch.linalg.vector_norm(values, dim=-1)
        return F.pad(scores, (sinks, 0), value=float(scores.max()) + 1)


@dataclass(frozen=True)
class Random(Method):
    """A seeded uniform draw."""

    def score(self, stats: LayerStats) -> Scores:
        gen = torch.Generator(device=stats.keys.device).manual_seed(stats.seed)
        shape = stats.keys.shape[:-1]
        return torch.rand(shape, generator=gen, device=stats.keys.device, dtype=torch.float64)


for _m in (
    StreamingLLM("streaming_llm", f"StreamingLLM: {N_SINK} sink tokens + the most recent"),
    H2O("h2o", "H2O: attention accumulated over all prefill queries"),
    ObservedAttention(
        "observed_attention",
        "kvpress's H2O: accumulated attention / number of queries seeing the key",
    ),
    SnapKV("snapkv", f"SnapKV: attention of {_window_text(None)}, avg-pooled (kernel {KERNEL})"),
    TOVA("tova", "TOVA: last query's attention, mean over the layer's heads"),
    KNorm("knorm", "key norm (Devoto et al.): keep low ‖k‖"),
    VATP("vatp", "value-aware (Guo et al.): accumulated α × ‖v‖₁"),
    VATP(
        "vatp_sinks",
        f"value-aware (Guo et al.): accumulated α × ‖v‖₁, first {N_SINK} tokens kept",
        sinks=N_SINK,
    ),
    H2ORecent("h2o_recent", "H2O as published: half heavy hitters, half recent tokens"),
    VATPProjected("vatp_wo", "value-aware, projected: accumulated α × ‖W_O v‖"),
    KeyDiff("keydiff", "KeyDiff (Park et al.): keep keys least like the head's mean key"),
    KeyDiff(
        "keydiff_sinks",
        f"KeyDiff with the first {N_SINK} tokens (sinks) always kept",
        sinks=N_SINK,
    ),
    CriticalKV("criticalkv", "CriticalKV: snapkv, then snapkv × ‖W_O v‖ (two stages)"),
    ExpectedAttention(
        "expected_attention",
        f"expected attention of future queries × ‖v‖ (window's query mean, covariance); "
        f"{N_SINK} sinks kept",
    ),
    WindowAttention("window_attention", f"mean α of {_window_text(None)}"),
    Contribution("contribution", f"ours: Σ |ĉ| over {_window_text(None)} and the group"),
    Contribution(
        "contribution_sinks",
        f"ours, with the first {N_SINK} tokens (sinks) always kept",
        sinks=N_SINK,
    ),
    Renormalised(
        "renormalised",
        f"ours, exact: Σ ‖Δo‖ on eviction (softmax renormalised) over {_window_text(None)} "
        "and the group",
    ),
    Renormalised(
        "renormalised_sinks",
        f"ours, exact renormalised effect, with the first {N_SINK} tokens (sinks) always kept",
        sinks=N_SINK,
    ),
    Random("random", "uniform random (seeded)"),
    AdaKV(
        "adakv_snapkv",
        "AdaKV on snapkv: the layer's budget shared by its KV heads (joint top-k of snapkv's "
        "scores), each head keeping at least 0.2 of its share",
    ),
    AdaKV(
        "adakv_contribution",
        "AdaKV on contribution: the layer's budget shared by its KV heads (joint top-k of "
        "Σ |ĉ|), each head keeping at least 0.2 of its share",
        base="contribution",
    ),
    AdaKV(
        "adakv_renormalised",
        "AdaKV on renormalised: the layer's budget shared by its KV heads (joint top-k of "
        "Σ ‖Δo‖), each head keeping at least 0.2 of its share",
        base="renormalised",
    ),
):
    register_method(_m)
