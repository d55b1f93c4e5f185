"""KV-cache eviction methods registered by name, as pure maths on per-layer statistics.

A :class:`Method` maps a :class:`LayerStats` (what one attention layer showed during the
prefill, gathered on the capture path by :mod:`.scoring`) to a ``(B, G, T)`` score per KV
head and cached position; the ``T × (1 − ratio)`` best-scored entries of each KV head are
kept (:mod:`.cache`). Adding a method is one function plus one :func:`register_method`.

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
* ``random`` — a seeded uniform draw.

Scores of GQA models are combined over the query heads of a KV group (sum or mean, which
rank alike) because one cached key/value serves the whole group.
"""

# ruff: noqa: F722  (jaxtyping shape strings are not forward references)

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor
from torch.nn import functional as F

from ..registry import Registry

N_SINK = 4
WINDOW = 64
KERNEL = 5

Scores = Float[Tensor, "b g t"]


@dataclass
class LayerStats:
    """What one attention layer showed during a prefill of ``T`` tokens (see :mod:`.scoring`).

    Attributes:
        keys: ``(B, G, T, d_h)`` cached keys (after RoPE), values ``(B, G, T, d_h)``.
        attn_sum: ``(B, H, T)`` Σ_i α_ij over every prefill query.
        window_probs: ``(B, H, w, T)`` α of the last ``w`` queries.
        window_contribution: ``(B, H, T)`` Σ_i |ĉ_ij^(h)| over the last ``w`` queries.
        projected_value_norm: ``(B, H, T)`` ‖W_O^(h) v_j‖.
        seed: for ``random``.
    """

    keys: Float[Tensor, "b g t dh"]
    values: Float[Tensor, "b g t dh"]
    attn_sum: Float[Tensor, "b h t"]
    window_probs: Float[Tensor, "b h w t"]
    window_contribution: Float[Tensor, "b h t"]
    projected_value_norm: Float[Tensor, "b h t"]
    seed: int = 0

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[1]

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    @property
    def window(self) -> int:
        return self.window_probs.shape[2]

    def per_kv_head(self, x: Float[Tensor, "b h t"], reduce: str = "mean") -> Scores:
        """``(B, H, T)`` → ``(B, G, T)`` over the query heads of each KV group."""
        b, h, t = x.shape
        grouped = x.reshape(b, self.num_kv_heads, h // self.num_kv_heads, t)
        return grouped.sum(2) if reduce == "sum" else grouped.mean(2)


@dataclass(frozen=True)
class Method:
    """A named eviction score: ``LayerStats -> (B, G, T)``, higher = keep."""

    name: str
    score: Callable[[LayerStats], Tensor]
    description: str


METHODS: Registry[Method] = Registry("KV-cache method")


def register_method(method: Method) -> Method:
    """Add (or replace) a method; ``cw kv-eval`` and :func:`~.compress` find it by name."""
    return METHODS.register(method)


def get_method(name: str) -> Method:
    return METHODS.get(name)


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
    out = scores.clone()
    out[..., :n] = scores.max() + 2
    return out


def _window_keys(stats: LayerStats) -> int:
    """Keys of the observation window (all but one position when the prefill is shorter)."""
    return min(stats.window, stats.length - 1)


# ---- the methods -------------------------------------------------------------------------
def streaming_llm(stats: LayerStats) -> Scores:
    t = stats.length
    pos = torch.arange(t, device=stats.keys.device, dtype=torch.float64)
    scores = pos.expand(stats.keys.shape[0], stats.num_kv_heads, t).clone()
    scores[..., :N_SINK] = t + 1.0  # sinks outrank every recent token
    return scores


def h2o(stats: LayerStats) -> Scores:
    return stats.per_kv_head(stats.attn_sum)


def observed_attention(stats: LayerStats) -> Scores:
    t = stats.length
    seen_by = torch.arange(t, 0, -1, device=stats.attn_sum.device, dtype=stats.attn_sum.dtype)
    return stats.per_kv_head(stats.attn_sum / seen_by)


def snapkv(stats: LayerStats) -> Scores:
    w = _window_keys(stats)
    probs = stats.window_probs[:, :, -w:, : stats.length - w]  # window queries, older keys
    scores = probs.mean(dim=-2)
    scores = F.avg_pool1d(scores, kernel_size=KERNEL, padding=KERNEL // 2, stride=1)
    scores = stats.per_kv_head(scores)
    return F.pad(scores, (0, w), value=float(scores.max()) + 1)


def tova(stats: LayerStats) -> Scores:
    last = stats.window_probs[:, :, -1, :-1].mean(1)  # (B, T-1), all heads of the layer
    scores = last[:, None].expand(-1, stats.num_kv_heads, -1)
    return F.pad(scores, (0, 1), value=float(scores.max()) + 1)


def knorm(stats: LayerStats) -> Scores:
    return -torch.linalg.vector_norm(stats.keys.float(), dim=-1).to(stats.keys.dtype)


def vatp(stats: LayerStats) -> Scores:
    return h2o(stats) * stats.values.abs().sum(-1)


def vatp_wo(stats: LayerStats) -> Scores:
    return stats.per_kv_head(stats.attn_sum * stats.projected_value_norm)


def window_attention(stats: LayerStats) -> Scores:
    scores = stats.per_kv_head(stats.window_probs.mean(2))
    return _protect_last(scores, _window_keys(stats))


def contribution(stats: LayerStats) -> Scores:
    scores = stats.per_kv_head(stats.window_contribution, reduce="sum")
    return _protect_last(scores, _window_keys(stats))


def contribution_sinks(stats: LayerStats) -> Scores:
    return _protect_first(contribution(stats), N_SINK)


def random(stats: LayerStats) -> Scores:
    gen = torch.Generator(device=stats.keys.device).manual_seed(stats.seed)
    shape = stats.keys.shape[:-1]
    return torch.rand(shape, generator=gen, device=stats.keys.device, dtype=torch.float64)


for _m in (
    Method("streaming_llm", streaming_llm, "StreamingLLM: 4 sink tokens + the most recent"),
    Method("h2o", h2o, "H2O: attention accumulated over all prefill queries"),
    Method(
        "observed_attention",
        observed_attention,
        "kvpress's H2O: accumulated attention / number of queries seeing the key",
    ),
    Method("snapkv", snapkv, "SnapKV: last-64-query attention, avg-pooled (kernel 5)"),
    Method("tova", tova, "TOVA: last query's attention, mean over the layer's heads"),
    Method("knorm", knorm, "key norm (Devoto et al.): keep low ‖k‖"),
    Method("vatp", vatp, "value-aware (Guo et al.): accumulated α × ‖v‖₁"),
    Method("vatp_wo", vatp_wo, "value-aware, projected: accumulated α × ‖W_O v‖"),
    Method("window_attention", window_attention, "mean α of the last 64 queries"),
    Method("contribution", contribution, "ours: Σ |ĉ| over the last 64 queries and the group"),
    Method(
        "contribution_sinks",
        contribution_sinks,
        "ours, with the first 4 tokens (sinks) always kept",
    ),
    Method("random", random, "uniform random (seeded)"),
):
    register_method(_m)
