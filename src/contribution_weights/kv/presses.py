"""Our KV-cache methods as kvpress presses (kvpress 0.5.5, an optional extra).

kvpress compresses the cache inside the prefill: a press's forward hook on every attention
layer is shown the layer's module, its input hidden states, the cached keys and values and
the forward's keyword arguments, and a ``ScorerPress`` returns a ``(B, G, T)`` score from
them. :func:`press` wraps any registered :class:`~.methods.Method` as such a press: the
:class:`~.methods.LayerStats` the method reads are rebuilt from what kvpress passes
(:func:`layer_stats`), and the method's own :meth:`~.methods.Method.score_for_budget` scores
them, so the press keeps what ``cw.kv.compress`` keeps::

    # in an environment with the extra (kvpress pins transformers < 5.3: not this
    # package's main environment; `make kvpress-check` builds .venv-kvpress)
    import kvpress  # registers the "kv-press-text-generation" pipeline
    from transformers import pipeline
    from contribution_weights.kv.presses import press

    p = press("contribution_sinks", compression_ratio=0.5)
    with p(model):                                   # model: a transformers causal LM
        model(input_ids=context_ids, past_key_values=cache)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    pipe(context, question=question, press=p)

Every registered method works, because every statistic can be rebuilt from the layer's
input: the queries are the module's ``q_proj`` (``qkv_proj`` for Phi-3) of the hidden
states, through its query norm (Qwen 3, Gemma 3) and RoPE (``position_embeddings`` of the
forward's arguments), as kvpress's own SnapKV rebuilds its window; the attention of any
query row is then ``softmax(scaling · q kᵀ)`` over the causal keys (soft-capped where the
module has ``attn_logit_softcapping``), and the contribution, the renormalised effect and
the projected value norms need the values and the module's ``o_proj``. The accumulated
attention of ``h2o``, ``observed_attention`` and the VATP methods rebuilds every query's
row (in row blocks); the window methods only the last ``window`` rows.

Head-adaptive methods (the ``adakv_*`` ones) become a ``BasePress`` that keeps every entry
and hands kvpress the evicted ones (``module.masked_key_indices``), as kvpress's own
AdaKVPress does: kvpress's attention patch then replaces their keys by a fake key that no
query attends to, on any attention implementation but eager (kvpress refuses eager there).
Wrapping a scorer press in kvpress's own ``AdaKVPress(press("contribution"))`` also works,
with kvpress's rounding of the safeguard (down, where ours rounds up).

What the presses cannot do: score a padded batch (kvpress prefills one unpadded sequence;
the rebuilt attention is the causal one), compress a sliding-window layer (skipped, as our
prefill skips them), or run on a module without ``q_proj`` / ``qkv_proj`` (GPT-2, GPT-NeoX,
which kvpress does not support either) or with learned attention sinks.

This module imports kvpress only inside :func:`press`; :func:`layer_stats` needs torch
alone (and is what ``tests/test_kv_presses.py`` checks against :func:`~.scoring.prefill`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..families import UnsupportedModelError, family_for
from ..measures.layer import LayerTensors, split_output_weight
from ..measures.layer import contribution as contribution_weights
from .methods import STATISTICS, WINDOW, LayerStats, Method, get_method, method_needs
from .renormalised import renormalised_effect

#: the kvpress release the presses are written for and checked against
KVPRESS_VERSION = "0.5.5"

#: statistics read off the window's query rows (the rest read keys and values alone)
_WINDOW_STATS = frozenset(
    {
        "window_probs",
        "window_contribution",
        "projected_value_norm",
        "window_queries",
        "window_renormalised",
    }
)
#: at most this many bytes of attention probabilities at once when every row is rebuilt
_BLOCK_BYTES = 256 * 2**20

MISSING_KVPRESS = (
    "contribution_weights.kv.presses needs kvpress {version}, which is not installed here. "
    "It is the optional extra 'contribution-weights[kvpress]' (kvpress=={version} with "
    "transformers>=5.0,<5.3), which conflicts with this package's main environment "
    "(transformers 5.24), so install it in a separate virtual environment: `make "
    "kvpress-check` builds one in .venv-kvpress (docs/kv-cache.md, 'Our methods in kvpress')."
)


# ---- the statistics, from what a kvpress hook is shown -----------------------------------
@torch.no_grad()
def layer_stats(
    module: Any,
    hidden_states: Tensor,
    keys: Tensor,
    values: Tensor,
    position_embeddings: tuple[Tensor, Tensor] | None,
    *,
    needs: Iterable[str] = STATISTICS,
    window: int = WINDOW,
    windows: Iterable[int] = (),
    seed: int = 0,
) -> LayerStats:
    """The :class:`~.methods.LayerStats` of one attention layer's prefill, rebuilt from
    what a kvpress forward hook is shown.

    Args:
        module: the attention module (``q_proj`` or ``qkv_proj``, ``o_proj``, optional
            ``q_norm``, ``scaling``, ``layer_idx``, ``config``).
        hidden_states: ``(B, T, d)`` the module's input.
        keys, values: ``(B, G, T, d_h)`` what the prefill cached (keys after RoPE).
        position_embeddings: ``(cos, sin)``, each ``(B, T, r)`` (``r`` the rotated dims),
            as the forward received them; None for a model without RoPE.
        needs: the statistics to rebuild (:data:`~.methods.STATISTICS`).
        window: the observation window (last queries); ``windows``: shorter windows to sum
            the contribution and the renormalised effect over, as :func:`~.scoring.prefill`.
        seed: ``LayerStats.seed`` is ``seed + layer_idx``, as the prefill's.

    The statistics are those :class:`~.scoring.StatsObserver` gathers, in the compute dtype
    ``promote(model dtype, float32)``; the probabilities follow the family's eager
    attention (softmax in float32, cast back to the model's dtype).
    """
    need = set(needs)
    unknown = need - set(STATISTICS)
    if unknown:
        raise ValueError(f"unknown statistics {sorted(unknown)}; known: {STATISTICS}")
    if window < 1:
        raise ValueError(f"window must be at least 1 query, got {window}")
    b, t, _ = hidden_states.shape
    if keys.shape[2] != t or values.shape[2] != t:
        raise ValueError(
            f"a press scores the prefill: {t} hidden states but {keys.shape[2]} cached keys "
            "(kvpress compresses a prefill of one unpadded sequence into an empty cache)"
        )
    scaling = float(getattr(module, "scaling", keys.shape[-1] ** -0.5))
    layer_idx = int(getattr(module, "layer_idx", 0) or 0)
    stats = LayerStats(
        keys=keys, values=values, scaling=scaling, seed=seed + layer_idx, window=window
    )
    if not need & (_WINDOW_STATS | {"attn_sum"}):
        return stats
    spec = family_for(module.config)
    dtype = torch.promote_types(hidden_states.dtype, torch.float32)
    queries = prefill_queries(module, hidden_states, position_embeddings)
    w = min(window, t)

    def probs(rows: slice) -> Tensor:
        return _attention(module, queries[:, :, rows], keys, rows, scaling, spec.softmax_float32)

    if "attn_sum" in need:
        h = queries.shape[1]
        step = max(1, _BLOCK_BYTES // max(1, b * h * t * queries.element_size()))
        total = torch.zeros(b, h, t, dtype=dtype, device=keys.device)
        for start in range(0, t, step):
            total += probs(slice(start, min(t, start + step))).to(dtype).sum(2)
        stats.attn_sum = total
    if not need & _WINDOW_STATS:
        return stats
    rows = slice(t - w, t)
    window_probs = probs(rows)
    if "window_probs" in need:
        stats.window_probs = window_probs.to(dtype)
    if "window_queries" in need:
        stats.window_queries = queries[:, :, rows].to(dtype)
    if not need & {"window_contribution", "window_renormalised", "projected_value_norm"}:
        return stats
    weight, bias = spec.output_weight(module)
    w_o = split_output_weight(weight.detach().to(keys.device, dtype), queries.shape[1])
    b_o = None if bias is None else bias.detach().to(keys.device, dtype)
    valid = _causal(rows, t, keys.device).expand(b, -1, -1)
    lt = LayerTensors(window_probs.to(dtype), values.to(dtype), w_o, b_o, valid)
    shorter = sorted({n for n in windows if 0 < n < window})
    if "window_contribution" in need:
        c = contribution_weights(lt).abs()  # (B, H, w, T)
        stats.window_contribution = c.sum(2)
        stats.contribution_by_window = {n: c[:, :, max(0, w - n) :].sum(2) for n in shorter}
    if "window_renormalised" in need:
        r = renormalised_effect(lt.probs, lt.head_values, lt.head_states, lt.gram)
        stats.window_renormalised = r.sum(2)
        stats.renormalised_by_window = {n: r[:, :, max(0, w - n) :].sum(2) for n in shorter}
    if "projected_value_norm" in need:
        stats.projected_value_norm = lt.value_norm
    return stats


def prefill_queries(
    module: Any, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor] | None
) -> Tensor:
    """``(B, H, T, d_h)`` the queries as the attention saw them: the module's query
    projection of its input, its query norm where it has one, then RoPE."""
    b, t, _ = hidden_states.shape
    config = module.config
    h = int(config.num_attention_heads)
    d_h = int(getattr(module, "head_dim", None) or config.hidden_size // h)
    if hasattr(module, "q_proj"):
        q = module.q_proj(hidden_states)
    elif hasattr(module, "qkv_proj"):  # Phi-3: queries first
        q = module.qkv_proj(hidden_states)[..., : h * d_h]
    else:
        raise UnsupportedModelError(
            f"{type(module).__name__} has no q_proj or qkv_proj: the presses rebuild the "
            "queries from the hidden states as kvpress does (Llama-like attention only)"
        )
    if getattr(module, "sinks", None) is not None:
        raise UnsupportedModelError("learned attention sinks are not supported by the presses")
    q = q.view(b, t, h, d_h)
    norm = getattr(module, "q_norm", None)
    if norm is not None:  # Qwen 3, Gemma 3: per-head RMSNorm before RoPE
        q = norm(q)
    q = q.transpose(1, 2)
    if position_embeddings is None:
        return q
    cos, sin = (x.unsqueeze(1) for x in position_embeddings)
    r = cos.shape[-1]
    if r == d_h:
        return (q * cos) + (_rotate_half(q) * sin)
    q_rot, q_pass = q[..., :r], q[..., r:]  # partial rotary
    return torch.cat([(q_rot * cos) + (_rotate_half(q_rot) * sin), q_pass], dim=-1)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _causal(rows: slice, t: int, device: torch.device) -> Tensor:
    """``(1, I, T)`` bool: where the prefill's query rows may attend."""
    q_pos = torch.arange(rows.start, rows.stop, device=device)
    return (torch.arange(t, device=device)[None, :] <= q_pos[:, None])[None]


def _attention(
    module: Any,
    queries: Tensor,
    keys: Tensor,
    rows: slice,
    scaling: float,
    softmax_float32: bool,
) -> Tensor:
    """``(B, H, I, T)`` probabilities of the query rows ``rows``, as eager attention."""
    rep = queries.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(rep, dim=1) if rep > 1 else keys
    scores = torch.matmul(queries, k.transpose(2, 3)) * scaling
    softcap = getattr(module, "attn_logit_softcapping", None)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    later = ~_causal(rows, keys.shape[2], keys.device)[:, None]
    scores = scores.masked_fill(later, torch.finfo(scores.dtype).min)
    if softmax_float32:
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(queries.dtype)
    return torch.softmax(scores, dim=-1).type(keys.dtype)


def is_sliding(module: Any) -> bool:
    """Whether the attention module is a sliding-window layer (not compressed)."""
    if getattr(module, "is_sliding", False) or getattr(module, "sliding_window", None):
        return True
    config = module.config
    types = getattr(config, "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    if types and idx is not None and idx < len(types):
        return "sliding" in str(types[idx])
    return types is None and getattr(config, "sliding_window", None) is not None


# ---- the presses -------------------------------------------------------------------------
def press(
    method: str | Method,
    compression_ratio: float = 0.0,
    *,
    window: int = WINDOW,
    seed: int = 0,
) -> Any:
    """A kvpress press that compresses by ``method`` (a registered name or a
    :class:`~.methods.Method`) at ``compression_ratio`` (the fraction evicted).

    ``window`` is the observation window (64 by default, as ``cw.kv.prefill``); a method
    with a shorter window of its own reads its last queries. ``seed`` seeds ``random``
    (per layer, ``seed + layer_idx``). A head-adaptive method gives a ``BasePress``
    (entries masked, as kvpress's AdaKVPress), every other a ``ScorerPress``.

    Raises:
        ImportError: kvpress is not installed (it lives in its own environment).
    """
    spec = get_method(method)
    scorer, adaptive = _press_classes()
    cls = adaptive if spec.head_adaptive else scorer
    return cls(compression_ratio=compression_ratio, method=spec, window=window, seed=seed)


def _import_kvpress() -> Any:
    try:
        import kvpress
    except ImportError as err:
        raise ImportError(MISSING_KVPRESS.format(version=KVPRESS_VERSION)) from err
    return kvpress


@functools.cache
def _press_classes() -> tuple[type, type]:
    """The two press classes, built on kvpress's once it is importable."""
    kvpress = _import_kvpress()
    from kvpress.utils import compute_n_kept

    scorer_press: Any = kvpress.ScorerPress
    base_press: Any = kvpress.BasePress

    @dataclass
    class _MethodMixin:
        """What both presses share: their fields, the method's statistics of a layer, and
        :meth:`compress` (kvpress's hook on every attention layer)."""

        compression_ratio: float = 0.0
        method: Any = "contribution"
        window: int = WINDOW
        seed: int = 0

        def _check(self) -> None:
            self.method = get_method(self.method)
            wq = self.method.window_queries
            if wq is not None and wq > self.window:
                raise ValueError(
                    f"method {self.method.name!r} reads the last {wq} queries but the press's "
                    f"observation window is {self.window}; pass window={wq}"
                )

        def stats(
            self,
            module: Any,
            hidden_states: Tensor,
            keys: Tensor,
            values: Tensor,
            kwargs: dict,
        ) -> LayerStats:
            wq = self.method.window_queries
            return layer_stats(
                module,
                hidden_states,
                keys,
                values,
                kwargs.get("position_embeddings"),
                needs=method_needs(self.method),
                window=self.window,
                windows=() if wq is None else (wq,),
                seed=self.seed,
            )

        def kept(self, keys: Tensor) -> int:
            return int(compute_n_kept(keys.shape[2], self.compression_ratio))

        def compress(
            self,
            module: Any,
            hidden_states: Tensor,
            keys: Tensor,
            values: Tensor,
            attentions: Tensor | None,
            kwargs: dict,
        ) -> tuple[Tensor, Tensor]:
            """A sliding-window layer stays whole (our prefill skips them too). A scorer
            press has kvpress's ScorerPress evict by :meth:`score`; the head-adaptive press
            keeps every entry and hands kvpress the evicted ones to mask."""
            if is_sliding(module):
                return keys, values
            if isinstance(self, scorer_press):
                return scorer_press.compress(
                    self, module, hidden_states, keys, values, attentions, kwargs
                )
            if self.compression_ratio == 0:
                return keys, values
            if module.config._attn_implementation == "eager":
                raise ValueError(
                    f"{self.method.name!r} masks evicted entries through kvpress's attention "
                    "patch, which eager attention bypasses: load the model with "
                    "attn_implementation='sdpa' (as kvpress's AdaKVPress requires)"
                )
            stats = self.stats(module, hidden_states, keys, values, kwargs)
            keep = self.method.kept_mask(stats, self.kept(keys))
            batch, head, seq = (~keep).nonzero(as_tuple=True)
            module.masked_key_indices = (batch, head, seq)
            return keys, values

    @dataclass
    class MethodPress(_MethodMixin, scorer_press):
        """A contribution-weights KV method as a kvpress ScorerPress."""

        def __post_init__(self) -> None:
            super().__post_init__()
            self._check()
            if self.method.head_adaptive:
                raise ValueError(
                    f"{self.method.name!r} is head-adaptive: use press(), which builds a "
                    "HeadAdaptiveMethodPress for it"
                )

        def score(
            self,
            module: Any,
            hidden_states: Tensor,
            keys: Tensor,
            values: Tensor,
            attentions: Tensor | None,
            kwargs: dict,
        ) -> Tensor:
            stats = self.stats(module, hidden_states, keys, values, kwargs)
            return self.method.score_for_budget(stats, self.kept(keys))

    @dataclass
    class HeadAdaptiveMethodPress(_MethodMixin, base_press):
        """A head-adaptive contribution-weights KV method (AdaKV) as a kvpress press: the
        evicted entries are masked (kvpress's fake keys), not removed."""

        method: Any = "adakv_contribution"

        def __post_init__(self) -> None:
            if not 0 <= self.compression_ratio < 1:
                raise ValueError("compression_ratio must lie in [0, 1)")
            self._check()

    for cls in (MethodPress, HeadAdaptiveMethodPress):
        cls.__module__ = __name__
    return MethodPress, HeadAdaptiveMethodPress
