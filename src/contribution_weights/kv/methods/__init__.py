"""KV-cache eviction methods registered by name, as pure maths on per-layer statistics.

A :class:`Method` maps a :class:`LayerStats` (what one attention layer showed during the
prefill, gathered on the capture path by :mod:`..scoring`) to a ``(B, G, T)`` score per KV
head and cached position; the ``T × (1 − ratio)`` best-scored entries of each KV head are
kept (:mod:`..cache`). Adding a method is one function plus one :func:`register_method`.
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
  (:mod:`..renormalised`), summed over the last ``window`` queries and the query heads of
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

One method a file, as kvpress has one press a file: :mod:`.stats` (:class:`LayerStats`),
:mod:`.base` (:class:`Method`, the registry, the helpers the scores share), then a module
each method (:mod:`.snapkv`, :mod:`.contribution`, …). This module registers the methods,
in the order the CLI and the tables list them.
"""

from __future__ import annotations

from .adakv import AdaKV
from .base import (
    METHODS,
    N_SINK,
    Method,
    WindowSum,
    _window_text,
    get_method,
    method_names,
    method_needs,
    register_method,
    resolve_methods,
)
from .contribution import Contribution
from .criticalkv import CriticalKV
from .expected_attention import ExpectedAttention
from .h2o import H2O
from .h2o_recent import H2ORecent
from .keydiff import KeyDiff
from .knorm import KNorm
from .observed_attention import ObservedAttention
from .random import Random
from .renormalised import Renormalised
from .snapkv import KERNEL, SnapKV
from .stats import STATISTICS, WINDOW, LayerStats, Scores
from .streaming_llm import StreamingLLM
from .tova import TOVA
from .vatp import VATP
from .vatp_projected import VATPProjected
from .window_attention import WindowAttention

#: the statistics, the base and the registry, then each method in the order it is registered
__all__ = [  # noqa: RUF022 (not sorted: registration order)
    "STATISTICS",
    "WINDOW",
    "LayerStats",
    "Scores",
    "N_SINK",
    "Method",
    "WindowSum",
    "METHODS",
    "get_method",
    "method_names",
    "method_needs",
    "register_method",
    "resolve_methods",
    "StreamingLLM",
    "H2O",
    "ObservedAttention",
    "KERNEL",
    "SnapKV",
    "TOVA",
    "KNorm",
    "VATP",
    "H2ORecent",
    "VATPProjected",
    "KeyDiff",
    "CriticalKV",
    "ExpectedAttention",
    "WindowAttention",
    "Contribution",
    "Renormalised",
    "Random",
    "AdaKV",
]


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
