"""The observer that records a trace during the forward (:class:`TraceRecorder`).

For each traced layer and block of queries it reads the block's pure-maths
:class:`~contribution_weights.measures.layer.LayerTensors` in the compute dtype (from the
:class:`~contribution_weights.capture.LayerBlock` capture shows every observer), writes
the stored maps into the map store (straight into it where the store offers a
destination), folds every requested measure into the reductions, and keeps the per-layer
vectors that derived measures are read from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from ..capture import LayerBlock, LayerCall, key_range
from ..measures.kernels import BlockSums, compiled_measure_sums, deriver
from ..measures.layer import Factors, LayerVectors
from ..measures.reductions import (
    ReductionAccumulator,
    chunk_candidates,
    chunked,
    follows,
    top_indices,
)
from ..measures.registry import (
    AbsoluteOf,
    RankOne,
    RowScaled,
    ScaledBlock,
    get_measure,
    stored_measures,
)
from .storage import MapStore, is_causal


@dataclass
class TraceRecorder:
    """Observer writing the traced layers' stored maps, reductions and vectors."""

    measures: list[str]
    layers: list[int]
    num_tokens: int
    dtype: torch.dtype
    store: MapStore | None = None
    reducer: ReductionAccumulator | None = None
    vectors: dict[str, Tensor] = field(default_factory=dict)
    progress: Any = None  # a bar advanced once per block of queries
    blocks_per_layer: int = 1
    eager_everywhere: bool = False  # untraced layers too (see TraceOptions.exact_inputs)

    key_spans = True  # blocks come narrowed to the keys their queries can see

    def __post_init__(self) -> None:
        self._position = {layer: pos for pos, layer in enumerate(self.layers)}
        self.stored = list(self.store.names) if self.store is not None else []

    def wants(self, layer_idx: int) -> bool:
        return self.eager_everywhere or layer_idx in self._position

    def skipped(self, call: LayerCall) -> None:
        if self.progress is not None:
            self.progress.update(self.blocks_per_layer)

    def _allocate(self, call: LayerCall) -> None:
        n, h, t = len(self.layers), call.num_heads, self.num_tokens
        device, dtype = call.query.device, self.dtype
        self.vectors = {
            "bias_share": torch.zeros(n, t, dtype=dtype, device=device),
            "degenerate": torch.zeros(n, t, dtype=torch.bool, device=device),
            "degenerate_heads": torch.zeros(n, h, t, dtype=torch.bool, device=device),
            "zero_values": torch.zeros(n, h, t, dtype=torch.bool, device=device),
            "value_norm": torch.zeros(n, h, t, dtype=dtype, device=device),
            "output_norm": torch.zeros(n, t, dtype=dtype, device=device),
            "key_start": torch.zeros(n, t, dtype=torch.int32, device=device),
            "key_stop": torch.zeros(n, t, dtype=torch.int32, device=device),
        }

    def observe(self, view: LayerBlock) -> None:
        call, rows = view.call, view.rows
        pos = self._position.get(call.layer_idx)
        if pos is None:
            return
        if not self.vectors:
            self._allocate(call)
        keys = view.key_range
        k0 = keys.start
        lt = view.tensors(self.dtype)  # shared with any other observer of the block
        start, stop = key_range(lt.valid[0], call.layer_idx)
        v = self.vectors
        v["key_start"][pos, rows] = start + k0
        v["key_stop"][pos, rows] = stop + k0
        store = self.store
        if store is not None and rows.start == 0:
            causal = is_causal(v["key_stop"][pos, rows])
            store.start_layer(pos, causal=causal and call.q_len == call.k_len)
        computed: dict[str, Tensor] = {}
        for name in self.stored:
            assert store is not None
            measure = get_measure(name)
            dest = store.destination(name, pos, rows, keys, self.dtype)
            if dest is not None and measure.writes_out:
                computed[name] = measure.compute(lt, out=dest[None])[0]
            else:
                computed[name] = measure.compute(lt)[0]
                store.write(name, pos, rows, computed[name], k0)
        if self.reducer is not None:
            self._reduce(lt, pos, rows, computed, k0)
        self._keep_vectors(lt, pos, rows, keys)
        if store is not None and rows.stop == call.q_len:
            store.finish_layer(pos)
        if self.progress is not None:
            self.progress.update(1)

    def _keep_vectors(self, vec: LayerVectors, pos: int, rows: slice, keys: slice) -> None:
        """The per-query and per-key vectors of traced layer ``pos`` (a batch of one) that
        derived measures and the trace's readers use, for queries ``rows`` and keys
        ``keys``, cast to the trace's dtype."""
        v = self.vectors
        v["bias_share"][pos, rows] = vec.bias_share[0]
        v["degenerate"][pos, rows] = vec.degenerate[0]
        v["degenerate_heads"][pos, :, rows] = vec.degenerate_heads[0]
        v["output_norm"][pos, rows] = vec.output_norm[0]
        v["zero_values"][pos, :, keys] = vec.zero_values[0]
        v["value_norm"][pos, :, keys] = vec.value_norm[0]

    def tiled(self, call: LayerCall) -> bool:
        """Whether this layer is reduced whole by the tiled kernels (``kernels="triton"``,
        reductions only, one sequence without a cache) instead of block by block."""
        red = self.reducer
        return (
            red is not None
            and red.kernels.tiled
            and self.store is None
            and call.layer_idx in self._position
            and call.batch == 1
            and call.q_len == call.k_len
        )

    def observe_layer(self, call: LayerCall) -> Tensor:
        """Reduce a whole layer with :class:`~..measures.tiled.TiledLayer`: no map, no
        block of probabilities; returns its head states ``(H, T, d_h)`` (float32)."""
        from ..measures.tiled import TiledLayer

        red = self.reducer
        assert red is not None
        pos = self._position[call.layer_idx]
        if not self.vectors:
            self._allocate(call)
        start, stop = call.key_ranges()
        w_o, b_o, gram = call.output_blocks(torch.float32)
        layer = TiledLayer(
            call.query[0], call.key[0], call.value[0], start, stop, call.scaling,
            call.softcap, w_o, b_o, gram, precision=red.kernels.precision,
        )  # fmt: skip
        t = call.k_len
        # every measure's sums in one fused pair of launches
        reduced = layer.all_sums(self.measures, min(red.top_k, t))
        for name in self.measures:
            measure = get_measure(name)
            if isinstance(measure.algebra, RankOne):
                key_f = measure.algebra.key_factor(layer.vectors)[0]
                query_f = measure.algebra.query_factor(layer.vectors)[0]
                for rows in call.mask_blocks():
                    valid = call.valid(rows)[0]
                    red.add_rank_one(name, pos, rows.start, key_f, query_f[rows], valid, 0)
                continue
            sums, top = reduced[name]
            if red.top_slots(name, t) == 0:
                top = None
            if measure.is_weight:
                red.fold(name, pos, 0, sums, top, 0)
            else:
                red.fold_other(name, pos, 0, sums.col, sums.row, sums.first_value, 0)
        self.vectors["key_start"][pos] = start
        self.vectors["key_stop"][pos] = stop
        self._keep_vectors(layer.vectors, pos, slice(0, call.q_len), slice(0, t))
        if self.progress is not None:
            self.progress.update(self.blocks_per_layer)
        return layer.z

    def _reduce(self, lt: Any, pos: int, rows: slice, computed: dict[str, Tensor], k0: int) -> None:
        """Fold this block into the reductions. A measure whose algebra says how it follows
        from another traced measure (a row scaling, an absolute value) reuses that one's
        block; a rank-one measure needs no block at all (see ReductionAccumulator)."""
        assert self.reducer is not None
        red, q0 = self.reducer, rows.start
        if red.kernels.compiled and self._reduce_fused(lt, pos, rows, computed, k0):
            return
        blocks: dict[str, Tensor] = {}  # each computed measure's block
        sums: dict[str, BlockSums | None] = {}  # and its sums, as add() returns them
        later = []
        for name in self.measures:
            algebra = get_measure(name).algebra
            if isinstance(algebra, RankOne):
                key_f, query_f = algebra.key_factor(lt)[0], algebra.query_factor(lt)[0]
                red.add_rank_one(name, pos, q0, key_f, query_f, lt.valid[0], k0)
            elif follows(name, self.measures) is not None:
                later.append((name, algebra))
            elif isinstance(algebra, ScaledBlock) and name not in computed:
                red.add_scaled_block(name, pos, q0, *algebra.parts(lt), k0)
            else:
                measure = get_measure(name)
                w = computed.get(name)
                if w is None:
                    w = measure.compute(lt)[0]
                terms = None if measure.log_terms is None else measure.log_terms(lt)
                sums[name] = red.add(name, pos, q0, w, k0, log_terms=terms)
                blocks[name] = w
        for name, algebra in later:
            assert isinstance(algebra, RowScaled | AbsoluteOf)
            if isinstance(algebra, RowScaled):
                scale = algebra.scale(lt)[0]
                red.add_row_scaled(name, algebra.base, pos, q0, blocks[algebra.base], scale, k0)
            else:
                base_sums = sums[algebra.base]
                assert base_sums is not None  # follows() pairs weights only
                red.add_abs_of(name, algebra.base, pos, q0, base_sums, k0)

    def _reduce_fused(
        self, lt: Any, pos: int, rows: slice, computed: dict[str, Tensor], k0: int
    ) -> bool:
        """Every measure's sums from the stored maps' blocks in one compiled pass
        (:func:`~..measures.kernels.fused_measure_sums`); the top keys from the chunks'
        maxima, the candidates' values read by the same recipes. False (the caller then
        reduces measure by measure) when the compiled pass fails."""
        red = self.reducer
        assert red is not None
        names, basis = self._fused_names, self._basis
        if not names:
            return False
        dtype = red.results[names[0]].token_sums.dtype
        blocks = [
            (computed[b] if b in computed else get_measure(b).compute(lt)[0]).to(dtype)
            for b in basis
        ]
        norms = (lt.value_norm[0][:, None, :], lt.output_norm[0][None, :, None], lt.valid[0][None])
        fused = compiled_measure_sums(names, basis)  # lazy: compiled on the first call
        try:
            out = list(fused(*blocks, *norms))
        except Exception as err:  # any backend failure: the plain path, said once
            red.kernels.failed(err)
            return False
        factors = Factors(dict(zip(basis, blocks, strict=True)), *norms)
        later = []
        for name in names:
            measure = get_measure(name)
            if not measure.is_weight:
                col, row, first = out[:3]
                del out[:3]
                red.fold_other(name, pos, rows.start, col, row, first, k0)
                continue
            sums = BlockSums(*out[:8])
            del out[:8]
            if follows(name, self.measures) is not None:
                later.append((name, sums))  # its top keys are its base's: after the base
                continue
            k = red.top_slots(name, sums.col.shape[-1])
            top = _top(name, basis, factors, sums, k) if k else None
            red.fold(name, pos, rows.start, sums, top, k0)
        for name, sums in later:
            # as add_row_scaled / add_abs_of: the entropies and top keys are the base's (it
            # shares its top-keys tensor), the top values follow from the base's
            algebra = get_measure(name).algebra
            assert isinstance(algebra, RowScaled | AbsoluteOf)
            red.fold(name, pos, rows.start, sums, None, k0)
            if isinstance(algebra, RowScaled):
                scaled = _rows_scaled_by(algebra.scale(lt)[0].to(dtype))
                red.follow(name, algebra.base, pos, rows, scaled)
            else:
                red.follow(name, algebra.base, pos, rows, torch.abs)
        for name in self.measures:
            algebra = get_measure(name).algebra
            if isinstance(algebra, RankOne):
                key_f, query_f = algebra.key_factor(lt)[0], algebra.query_factor(lt)[0]
                red.add_rank_one(name, pos, rows.start, key_f, query_f, lt.valid[0], k0)
        return True

    @cached_property
    def _fused_names(self) -> list[str]:
        """The measures the fused pass sums (rank-one ones need no block)."""
        return [n for n in self.measures if not isinstance(get_measure(n).algebra, RankOne)]

    @cached_property
    def _basis(self) -> list[str]:
        """The maps the fused pass reads every measure from: the stored ones, else the
        fewest that serve them all (:func:`~..measures.registry.stored_measures`)."""
        return self.stored or stored_measures(self._fused_names, self.dtype)


def _rows_scaled_by(scale: Tensor) -> Callable[[Tensor], Tensor]:
    """Top values ``(H, I, k)`` of a base measure → those of its row scaling by ``scale``."""
    return lambda values: values * scale[:, None]


def _top(name: str, basis: list[str], f: Factors, sums: BlockSums, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` top keys of a measure read from the factors ``f`` by its recipe: among the
    ``k`` chunks of largest maximum (the maxima came with the sums), the measure computed
    on those chunks' keys only; rows too short for chunks are computed whole."""
    derive = deriver(name, basis)
    signed = get_measure(name).signed
    t = sums.col.shape[-1]
    if not chunked(t, k) or sums.maxima is None:
        w = derive(f)
        idx = top_indices(w.abs() if signed else w, k)
        return idx, w.gather(-1, idx)
    cols, inside = chunk_candidates(sums.maxima, k, t)
    h, i = cols.shape[:2]
    gathered = Factors(
        maps={s: m.gather(-1, cols) for s, m in f.maps.items()},
        value_norm=f.value_norm.expand(h, i, t).gather(-1, cols),
        output_norm=f.output_norm,
        valid=f.valid.expand(h, i, t).gather(-1, cols),
    )
    w = derive(gathered)
    a = (w.abs() if signed else w).masked_fill(~inside, -1.0)
    pick = torch.topk(a, k, dim=-1).indices
    return cols.gather(-1, pick), w.gather(-1, pick)
