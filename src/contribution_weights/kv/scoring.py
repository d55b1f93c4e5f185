"""Scoring a prefill for KV-cache eviction, on the library's capture path.

:func:`prefill` runs the model once over the context inside
:func:`~contribution_weights.capture.capturing` with a :class:`StatsObserver`, and returns
the cache the model filled together with one :class:`~.methods.LayerStats` per
compressible layer. Every method in :mod:`.methods` is then a cheap function of those
statistics, so one prefill serves all methods and ratios.

Speed. When no chosen method needs every query's attention (H2O, H2O with a recent
window, VATP and observed attention do; SnapKV, TOVA, the window methods, contribution,
the renormalised effect, CriticalKV on SnapKV, expected attention, KeyDiff, key norm and
StreamingLLM do not),
the observer names the window's queries (``query_rows``): every layer then runs on the
model's own sdpa kernel, and only the window's probabilities are computed eagerly. The
cache and logits then come from sdpa, not eager attention, and differ by float rounding
(about 1e-8 in float64 here) from a prefill whose methods need every query: compare methods
from one prefill (as ``cw kv-eval`` does within a run), not across runs with different
method sets.

Memory. Capture shows the observer the attention probabilities block by block (query
rows, see :mod:`~contribution_weights.capture`). The observer keeps, per layer, only
``(B, H, T)`` running sums (accumulated attention) and, for the rows of the last
``window`` queries, their ``(B, H, w, T)`` probabilities (and, for expected attention,
their ``(B, H, w, d_h)`` queries). The contribution ĉ and the renormalised effect ‖Δo‖
(:mod:`.renormalised`) are computed from the block's tensors for those window rows only
(:meth:`LayerBlock.tensors` with the window's rows), each summed over the rows at once:
nothing of size ``(H, T, T)`` is built beyond what capture itself builds for one block,
and nothing of size ``(w, T, d_h)``.

Sliding-window layers (Gemma 2/3, Mistral with a window) are not compressed: their cache
is already bounded by the window, and transformers sizes their attention masks from the
number of tokens seen, not the number cached. kvpress makes the same choice for Gemma 3.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..capture import LayerBlock, LayerCall, capturing, check_all_layers_seen
from ..loading import LoadedModel
from ..measures.layer import contribution as contribution_weights
from .methods import (
    STATISTICS,
    WINDOW,
    LayerStats,
    Method,
    get_method,
    method_names,
    method_needs,
)
from .renormalised import renormalised_effect

#: window statistics computed from the block's layer tensors (output projection included)
_FROM_BLOCK = frozenset({"window_contribution", "projected_value_norm", "window_renormalised"})


@dataclass
class _Partial:
    attn_sum: Tensor | None = None
    window_probs: list[Tensor] = field(default_factory=list)
    window_contribution: Tensor | None = None
    by_window: dict[int, Tensor] = field(default_factory=dict)
    projected_value_norm: Tensor | None = None
    window_queries: list[Tensor] = field(default_factory=list)
    window_renormalised: Tensor | None = None
    renormalised_by_window: dict[int, Tensor] = field(default_factory=dict)
    scaling: float = 1.0
    keys: Tensor | None = None
    values: Tensor | None = None


class StatsObserver:
    """Collects :class:`LayerStats` inputs for the layers in ``layers`` (capture Observer).

    ``needs`` names the statistics to gather (:data:`~.methods.STATISTICS`, default all);
    ``windows`` the shorter windows (numbers of last queries) to sum the contribution and
    the renormalised effect over besides the whole observation window.
    """

    def __init__(
        self,
        layers: set[int],
        window: int = WINDOW,
        needs: Iterable[str] = STATISTICS,
        windows: Iterable[int] = (),
        kernels: str = "torch",
    ) -> None:
        if kernels not in ("torch", "triton"):
            raise ValueError(f"kernels must be 'torch' or 'triton', not {kernels!r}")
        self.kernels = kernels
        if window < 1:
            raise ValueError(f"window must be at least 1 query, got {window}")
        self.layers = layers
        self.window = window
        self.needs = set(needs)
        unknown = self.needs - set(STATISTICS)
        if unknown:
            raise ValueError(f"unknown statistics {sorted(unknown)}; known: {STATISTICS}")
        self.windows = sorted({w for w in windows if 0 < w < window})
        self.partial: dict[int, _Partial] = {}

    def query_rows(self, call: LayerCall) -> slice | None:
        """Only the window's queries, unless a method needs every query's attention
        (``attn_sum``): then the layer runs on sdpa and only the window is eager."""
        if "attn_sum" in self.needs:
            return None
        # no window statistic: one row, to record the layer's keys and values
        window = min(self.window, call.q_len) if self.reads_window else 1
        return slice(call.q_len - window, call.q_len)

    def tiled(self, call: LayerCall) -> bool:
        """Whether the layer's every-query attention sums come from the tiled kernels
        (``kernels="triton"``, one sequence, no earlier cache): no block of probabilities
        is built for them, only the window's rows are computed eagerly."""
        return (
            self.kernels == "triton"
            and "attn_sum" in self.needs
            and call.layer_idx in self.layers
            and call.batch == 1
            and call.q_len == call.k_len
        )

    def observe_layer(self, call: LayerCall) -> Tensor:
        """The layer whole: Σ_i α_ij from the tiled kernels (the column sums of
        ``attention``), the window's statistics from its rows as :meth:`observe` computes
        them; returns the head states ``(H, T, d_h)`` (float32) the layer outputs."""
        from ..measures.tiled import TiledLayer

        start, stop = call.key_ranges()
        w_o, b_o, gram = call.output_blocks(torch.float32)
        layer = TiledLayer(
            call.query[0], call.key[0], call.value[0], start, stop, call.scaling,
            call.softcap, w_o, b_o, gram,
        )  # fmt: skip
        sums, _ = layer.sums("attention", 0)
        window = min(self.window, call.q_len) if self.reads_window else 1
        rows = slice(call.q_len - window, call.q_len)
        view = LayerBlock(call, rows, call.probs(rows))
        try:
            self.observe(view, attn_sum=sums.col[None])
        finally:
            view.close()
        return layer.z

    @property
    def reads_window(self) -> bool:
        """Whether the window's query rows are needed at all."""
        return bool(self.needs & {*_FROM_BLOCK, "window_probs", "window_queries"})

    def observe(self, view: LayerBlock, attn_sum: Tensor | None = None) -> None:
        """Fold a block of queries in; ``attn_sum``: the whole layer's Σ_i α_ij ``(B, H, T)``
        where the tiled kernels gave it (the block then adds only its window rows)."""
        call, rows, probs = view.call, view.rows, view.probs
        if call.layer_idx not in self.layers:
            return
        dtype = torch.promote_types(call.query.dtype, torch.float32)
        part = self.partial.get(call.layer_idx)
        if part is None:
            part = _Partial(
                keys=call.key.detach(), values=call.value.detach(), scaling=float(call.scaling)
            )
            if "attn_sum" in self.needs:
                b, h, t = call.batch, call.num_heads, call.k_len
                part.attn_sum = torch.zeros(b, h, t, dtype=dtype, device=probs.device)
            self.partial[call.layer_idx] = part
        if attn_sum is not None and part.attn_sum is not None:
            part.attn_sum += attn_sum.to(dtype)
        elif part.attn_sum is not None:
            part.attn_sum += probs.detach().to(dtype).sum(2)
        window = min(self.window, call.q_len)
        start = max(rows.start, call.q_len - window)
        if start >= rows.stop or not self.reads_window:
            return
        sub = slice(start, rows.stop)
        block = probs.detach()[:, :, start - rows.start :]
        if "window_probs" in self.needs:
            part.window_probs.append(block.to(dtype))
        if "window_queries" in self.needs:
            part.window_queries.append(call.query.detach()[:, :, sub].to(dtype))
        if not self.needs & _FROM_BLOCK:
            return
        lt = view.tensors(dtype, rows=sub)  # shared with any other observer of these rows
        if "window_contribution" in self.needs:
            c = contribution_weights(lt).abs()  # (B, H, I, T) over these window rows
            part.window_contribution = _add(part.window_contribution, c.sum(2))
            self._add_windows(part.by_window, c, call.q_len - start)
        if "window_renormalised" in self.needs:
            # ‖Δo_ij^(h)‖ in the d_h-sized metric of W_O^(h)ᵀ W_O^(h): z_i, v_j, no ṽ built
            r = renormalised_effect(lt.probs, lt.head_values, lt.head_states, lt.gram)
            part.window_renormalised = _add(part.window_renormalised, r.sum(2))
            self._add_windows(part.renormalised_by_window, r, call.q_len - start)
        if part.projected_value_norm is None and "projected_value_norm" in self.needs:
            part.projected_value_norm = lt.value_norm

    def _add_windows(self, sums: dict[int, Tensor], x: Tensor, rows_left: int) -> None:
        """Add to ``sums[w]`` the rows of ``x`` ``(B, H, I, T)`` among the last ``w`` queries
        (``rows_left``: the queries from the first row of ``x`` to the end)."""
        for w in self.windows:
            first = max(0, rows_left - w)
            if first < x.shape[2]:
                sums[w] = _add(sums.get(w), x[:, :, first:].sum(2))

    def stats(self, seed: int) -> dict[int, LayerStats]:
        out = {}
        for idx, part in sorted(self.partial.items()):
            assert part.keys is not None and part.values is not None
            out[idx] = LayerStats(
                keys=part.keys,
                values=part.values,
                attn_sum=part.attn_sum,
                window_probs=torch.cat(part.window_probs, dim=2) if part.window_probs else None,
                window_contribution=part.window_contribution,
                projected_value_norm=part.projected_value_norm,
                window_queries=(
                    torch.cat(part.window_queries, dim=2) if part.window_queries else None
                ),
                window_renormalised=part.window_renormalised,
                scaling=part.scaling,
                seed=seed + idx,
                window=self.window,
                contribution_by_window=dict(part.by_window),
                renormalised_by_window=dict(part.renormalised_by_window),
            )
        return out


def _add(total: Tensor | None, x: Tensor) -> Tensor:
    return x if total is None else total + x


def compressible_layers(cache: object) -> list[int]:
    """Indices of the cache layers that hold every past token (not sliding-window ones)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(
            f"{type(cache).__name__} is not a transformers Cache with per-layer storage; "
            "pass the DynamicCache the model returned"
        )
    return [i for i, layer in enumerate(layers) if not getattr(layer, "is_sliding", False)]


@dataclass
class Prefill:
    """A scored prefill: the model's cache, its logits, and statistics per compressible layer."""

    ids: Tensor  # (B, T)
    cache: Any  # transformers Cache
    logits: Tensor  # (B, 1, V): the next-token logits after the prefill
    stats: dict[int, LayerStats]
    window: int

    @property
    def length(self) -> int:
        return int(self.ids.shape[1])


def _sliding_layer_ids(model: LoadedModel) -> set[int]:
    types = getattr(model.text_config, "layer_types", None) or []
    return {i for i, kind in enumerate(types) if "sliding" in str(kind)}


def prefill(
    model: LoadedModel,
    ids: Tensor,
    window: int = WINDOW,
    *,
    seed: int = 0,
    methods: Iterable[str | Method] | None = None,
    kernels: str = "torch",
) -> Prefill:
    """Run ``ids`` ``(T,)`` or ``(B, T)`` through the model, keeping its cache and the
    statistics that ``methods`` need (default: every registered method), in one pass.

    ``window`` is the observation window (the last queries whose attention and
    contribution are kept); a method with a window of its own reads its last queries.
    ``kernels="triton"``: the methods that sum every query's attention (H2O, VATP,
    observed attention) read those sums from the tiled kernels (``measures/tiled.py``,
    float32, no block of probabilities), so their layers cost about three attention
    products instead of the eager pass; the window's rows stay eager. For one sequence.
    """
    if ids.dim() == 1:
        ids = ids[None]
    if ids.shape[1] < 2:
        raise ValueError("a prefill needs at least 2 tokens to compress")
    chosen = [get_method(m) for m in (method_names() if methods is None else methods)]
    needs = {stat for m in chosen for stat in method_needs(m)}
    windows = {m.window_queries for m in chosen if m.window_queries is not None}
    for m in chosen:
        if m.window_queries is not None and m.window_queries > window:
            raise ValueError(
                f"method {m.name!r} reads the last {m.window_queries} queries but the "
                f"observation window is {window}; prefill with window={m.window_queries}"
            )
    if kernels == "triton":
        from ..measures.tiled import available

        problem = available()
        if problem is not None:
            raise ValueError(f"{problem}; or prefill with kernels='torch'")
    net = model.model
    layers = set(range(model.num_layers)) - _sliding_layer_ids(model)
    observer = StatsObserver(
        layers, window, needs, {w for w in windows if w is not None}, kernels=kernels
    )
    ids = ids.to(net.device)
    with torch.no_grad(), capturing(net, observers=[observer]) as session:
        out = net(input_ids=ids, use_cache=True, **model.last_logits_only())
    check_all_layers_seen(session, model.num_layers)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    kept = set(compressible_layers(cache))
    stats = {i: s for i, s in observer.stats(seed).items() if i in kept}
    return Prefill(ids=ids, cache=cache, logits=out.logits, stats=stats, window=window)
