"""The result object of a trace: maps, reductions, tokens and metadata, with save/load.

A :class:`Trace` describes one sequence through the traced layers (``layers`` lists them):

* ``trace[name]`` is a :class:`~.maps.MeasureMap`, an ``(L, H, T, T)`` array read on
  demand from memory or disk. Derived measures (``vw``, ``vw_on``, ``relative_norm``,
  ``ihc``) are computed from the stored maps and the per-layer norms as they are read
  (:mod:`contribution_weights.measures.registry`);
* reductions per (layer, head) (:mod:`contribution_weights.measures.reductions`: token
  scores, first-token weight, entropy, top-k keys) come from the forward for a trace
  without maps (``maps=False``) and are computed layer by layer from the maps otherwise;
* per-layer vectors: ``bias_share`` ``(L, T)``, the zero-denominator flags ``degenerate``
  ``(L, T)``, ``degenerate_heads`` and ``zero_values`` ``(L, H, T)``, and the norms the
  derived measures need (``value_norm`` ``(L, H, T)``, ``output_norm`` ``(L, T)``, the
  first and one-past-last key each query may attend to, ``key_start``/``key_stop``).

On disk a trace is a folder (:mod:`.format`). The interactive report and figures of a
trace are in :mod:`contribution_weights.presentation` (``cw.report(trace)``); in Jupyter a
trace displays as that report.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import Tensor

from ..measures.layer import Factors
from ..measures.reductions import DEFAULT_TOP_K, MeasureReductions, ReductionAccumulator
from ..measures.registry import get_measure, measure_names
from .folder import staged, writer_lock
from .format import TRACE_ENTRIES, read_folder, write_metadata
from .maps import MeasureMap
from .query import sink_table, top_tokens
from .storage import DenseMaps, MapStore, PackedMaps, dtype_name, is_causal, storage_dtype

_READ_ELEMENTS = 1 << 25  # elements per block when reductions are computed from maps


@dataclass
class Trace:
    """Maps, reductions and vectors for one sequence (see module docstring)."""

    input_ids: Tensor
    tokens: list[str]
    layers: list[int]
    measures: list[str]
    num_heads: int
    vectors: dict[str, Tensor]
    maps: MapStore | None = None
    reductions: dict[str, MeasureReductions] = field(default_factory=dict)
    model_name: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None  # the folder holding the trace on disk, if any

    @classmethod
    def from_tensors(
        cls,
        measures: dict[str, Tensor],
        input_ids: Tensor,
        tokens: list[str],
        layers: list[int],
        bias_share: Tensor | None = None,
        degenerate: Tensor | None = None,
        model_name: str = "",
        meta: dict[str, Any] | None = None,
    ) -> Trace:
        """A trace of given ``(L, H, T, T)`` maps (every one stored as it is), for maps
        computed elsewhere or made up in tests; the flags default to none set."""
        first = next(iter(measures.values()))
        n, h, t, _ = first.shape
        maps = DenseMaps(list(measures), n, h, t, first.dtype)
        maps.tensors = dict(measures)
        vectors = {
            "bias_share": torch.zeros(n, t) if bias_share is None else bias_share,
            "degenerate": torch.zeros(n, t, dtype=torch.bool) if degenerate is None else degenerate,
        }
        return cls(
            input_ids=input_ids,
            tokens=list(tokens),
            layers=list(layers),
            measures=list(measures),
            num_heads=h,
            vectors=vectors,
            maps=maps,
            model_name=model_name,
            meta=dict(meta or {}),
        )

    # ---- access ----------------------------------------------------------------------
    def _not_traced(self, name: str) -> str:
        """Why ``name`` cannot be read, and how to trace it (or how it may be spelt)."""
        have = f"this trace has: {', '.join(self.measures)}"
        if name not in measure_names():
            close = difflib.get_close_matches(name, [*self.measures, *measure_names()], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            return f"no measure is called {name!r}; {have}{hint}"
        left_out = [m for m in measure_names() if not get_measure(m).in_all]
        hint = f" ('all' leaves out {', '.join(left_out)}: name them)" if name in left_out else ""
        return (
            f"measure {name!r} was not traced; {have}. Trace again with it named "
            f"(measures=[..., {name!r}], CLI: --measures ...,{name}){hint}"
        )

    def __getitem__(self, name: str) -> MeasureMap:
        if name not in self.measures and (self.maps is None or name not in self.maps.names):
            raise KeyError(self._not_traced(name))
        if self.maps is None:
            raise KeyError(
                f"this trace kept no maps (maps=False / --no-maps), so {name!r} has no "
                "T × T map; its reductions are there: token_scores, first_token_weight, "
                "entropy, top_k. Trace again with maps (and --out to stream them) to read maps"
            )
        return MeasureMap(self, name)

    def __contains__(self, name: object) -> bool:
        """True when the measure's map can be read (see :attr:`has_maps`)."""
        return self.maps is not None and name in self.measures

    @property
    def has_maps(self) -> bool:
        return self.maps is not None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def bias_share(self) -> Tensor:
        return self.vectors["bias_share"]

    @property
    def degenerate(self) -> Tensor:
        return self.vectors["degenerate"]

    @property
    def degenerate_heads(self) -> Tensor | None:
        return self.vectors.get("degenerate_heads")

    @property
    def zero_values(self) -> Tensor | None:
        return self.vectors.get("zero_values")

    @property
    def _read_dtype(self) -> torch.dtype:
        return torch.float64 if self.meta.get("storage_dtype") == "float64" else torch.float32

    def layer_position(self, layer: int) -> int:
        """Index into the first dimension of the maps for model layer ``layer``."""
        try:
            return self.layers.index(layer)
        except ValueError:
            raise ValueError(
                f"layer {layer} was not traced; traced layers: {self.layers}"
            ) from None

    def layer(self, layer: int) -> dict[str, Tensor]:
        """Every measure of model layer ``layer``, as ``(H, T, T)`` tensors."""
        pos = self.layer_position(layer)
        return {name: self[name][pos] for name in self.measures}

    def weight_measures(self) -> list[str]:
        return [m for m in self.measures if get_measure(m).is_weight]

    def _read(self, name: str, pos: int, heads: slice, rows: slice) -> Tensor:
        assert self.maps is not None
        if name in self.maps.names:
            return self.maps.read(name, pos, heads, rows)
        recipe = get_measure(name).recipe(self.maps.names)
        if recipe is None:
            raise KeyError(f"measure {name!r} is neither stored nor derivable in this trace")
        missing = [v for v in ("value_norm", "output_norm", "key_start") if v not in self.vectors]
        if missing:
            raise KeyError(f"measure {name!r} cannot be derived: the trace lacks {missing}")
        maps = {src: self.maps.read(src, pos, heads, rows) for src in recipe.sources}
        dtype = self._read_dtype
        keys = torch.arange(self.num_tokens)
        start = self.vectors["key_start"][pos, rows].long()
        stop = self.vectors["key_stop"][pos, rows].long()
        valid = (keys[None, :] >= start[:, None]) & (keys[None, :] < stop[:, None])
        factors = Factors(
            maps=maps,
            value_norm=self.vectors["value_norm"][pos, heads].to(dtype)[:, None, :],
            output_norm=self.vectors["output_norm"][pos, rows].to(dtype)[None, :, None],
            valid=valid[None],
        )
        return recipe.derive(factors)

    def iter_blocks(
        self, name: str, pos: int, heads: slice | None = None
    ) -> Iterator[tuple[int, Tensor]]:
        """``(first_query, (H, I, T))`` blocks of one layer's map (of the ``heads`` asked
        for, default all), of bounded size: never a whole layer of a long trace at once."""
        t = self.num_tokens
        heads = slice(0, self.num_heads) if heads is None else heads
        count = len(range(self.num_heads)[heads])
        step = max(1, _READ_ELEMENTS // max(1, count * t))
        for q0 in range(0, t, step):
            q1 = min(t, q0 + step)
            yield q0, self._read(name, pos, heads, slice(q0, q1))

    # ---- reductions and aggregates --------------------------------------------------
    def reduced(self, name: str, top_k: int = DEFAULT_TOP_K) -> MeasureReductions:
        """The reductions of a measure (computed from the maps on first use if need be)."""
        if name not in self.measures:
            raise KeyError(self._not_traced(name))
        have = self.reductions.get(name)
        if have is not None:
            kept = None if have.top_keys is None else have.top_keys.shape[-1]
            if kept is None or kept >= min(top_k, self.num_tokens) or self.maps is None:
                return have
        if self.maps is None:
            raise KeyError(f"this trace kept neither maps nor reductions of {name!r}")
        acc = ReductionAccumulator(
            [name], len(self.layers), self.num_heads, self.num_tokens, top_k, self._read_dtype
        )
        for pos in range(len(self.layers)):
            for q0, block in self.iter_blocks(name, pos):
                acc.add(name, pos, q0, block)
        self.reductions[name] = acc.results[name]
        return self.reductions[name]

    def kept_reductions(self, name: str) -> MeasureReductions:
        """The reductions of a measure as kept, whatever their top-k (token scores, first
        token, entropy do not depend on it): those a streamed trace or one without maps
        computed during the forward are used as they are, never recomputed from the maps."""
        have = self.reductions.get(name) if name in self.measures else None
        return have if have is not None else self.reduced(name)

    def token_scores(self, name: str) -> Tensor:
        """``(L, H, T)``: mean over queries i ≥ j of the measure (the faithfulness score)."""
        return self.kept_reductions(name).token_scores()

    def first_token_weight(self, name: str) -> Tensor:
        """``(L,)``: per-layer first-token weight of the normalised measure."""
        return self.kept_reductions(name).first_token_weight()

    def entropy(self, name: str, exclude_first: bool = False) -> float:
        """Mean over layers, heads and queries of the per-query entropy (paper Table 5)."""
        return self.kept_reductions(name).mean_entropy(exclude_first)

    def top_k(self, name: str, k: int = DEFAULT_TOP_K) -> tuple[Tensor, Tensor]:
        """``(values, keys)``, each ``(L, H, T, k)`` whatever T is: per query, the k keys
        of largest weight (largest |w| for signed measures, whose values keep their
        sign), ordered by |value|, largest first; equal values come in no set order.

        Slots a query cannot fill hold key −1 and value 0: query i sees at most i + 1
        keys (fewer in a sliding window), so early queries (all of them when T < k) have
        empty slots, and keys of zero weight are never ranked. ``keys`` are int16 (int32
        beyond 32,768 tokens), ``values`` the trace's compute dtype.

        A ``k`` up to the ``top_k`` the trace kept (default 8) gives the first k of those.
        A larger ``k`` is computed from the maps for a trace with maps (and kept for later
        calls); a trace without maps (``maps=False``) raises a ValueError naming the
        ``top_k`` to trace with, unless its ``top_k`` was at least T (every key kept).
        """
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"k must be an integer, 0 or more, not {k!r}")
        if name in self.measures and not get_measure(name).is_weight:
            raise ValueError(f"{name!r} is not a weight measure; top-k is kept for weights")
        r = self.reduced(name, top_k=k)
        kept = 0 if r.top_keys is None else r.top_keys.shape[-1]
        if kept < min(k, self.num_tokens):
            raise ValueError(
                f"this trace kept the top {kept} keys per query; "
                f"trace again with top_k={k} (CLI --top-k {k})"
            )
        lead = (len(self.layers), self.num_heads, self.num_tokens)
        if r.top_values is None or r.top_keys is None:  # none kept (top_k=0), so k is 0
            values = r.token_sums.new_zeros(*lead, 0)
            keys = torch.zeros(*lead, 0, dtype=torch.int16)
        else:
            values, keys = r.top_values[..., :k], r.top_keys[..., :k]
        missing = k - keys.shape[-1]
        if missing > 0:  # folders written before reductions kept k slots when T < k
            values = torch.cat([values, values.new_zeros(*values.shape[:-1], missing)], -1)
            keys = torch.cat([keys, keys.new_full((*keys.shape[:-1], missing), -1)], -1)
        return values, keys

    def summary(self) -> pd.DataFrame:
        """First-token weight and entropy (with and without token 0) per weight measure."""
        rows = []
        for name in self.weight_measures():
            rows.append(
                {
                    "measure": name,
                    "first_token_weight": float(self.first_token_weight(name).mean()),
                    "entropy": self.entropy(name),
                    "entropy_excl_first": self.entropy(name, exclude_first=True)
                    if self.num_tokens > 1
                    else float("nan"),
                }
            )
        columns = ["measure", "first_token_weight", "entropy", "entropy_excl_first"]
        return pd.DataFrame(rows, columns=columns).set_index("measure")

    #: ``trace.top_tokens(layer, query=-1, k=8, measure="contribution", heads=False,
    #: exclude_first=False)``: the ``k`` tokens query ``query`` (default the last) draws on
    #: most at model layer ``layer``, by their share of ``measure`` summed over heads,
    #: attention beside contribution, per head with ``heads`` (:func:`~.query.top_tokens`,
    #: this trace its first argument)
    top_tokens = top_tokens

    def sinks(self, threshold: float | None = None) -> pd.DataFrame:
        """Per traced layer: mean attention to token 0, token 0's share of the
        contribution, and whether the layer is a sink layer (attention to token 0 above
        ``threshold``, default the geometry analysis's 0.5) (:func:`~.query.sink_table`)."""
        return sink_table(self) if threshold is None else sink_table(self, threshold)

    def first_token_weight_by_layer(self) -> pd.DataFrame:
        """Layers × weight measures table of the first-token weight."""
        data = {m: self.first_token_weight(m).tolist() for m in self.weight_measures()}
        return pd.DataFrame(data, index=pd.Index(self.layers, name="layer"))

    def to_dataframe(self, measures: list[str] | None = None) -> pd.DataFrame:
        """Long table: one row per (layer, head, query, key) with key ≤ query."""
        names = list(self.measures) if measures is None else list(measures)
        if not names:
            raise ValueError(
                f"name at least one measure; this trace has: {', '.join(self.measures)}"
            )
        maps = [self[name] for name in names]
        t, n_h = self.num_tokens, self.num_heads
        qi, kj = torch.tril_indices(t, t)
        frames = []
        for pos, layer in enumerate(self.layers):
            frame: dict[str, Any] = {
                "layer": torch.full((n_h * len(qi),), layer).numpy(),
                "head": torch.arange(n_h).repeat_interleave(len(qi)).numpy(),
                "query": qi.repeat(n_h).numpy(),
                "key": kj.repeat(n_h).numpy(),
            }
            for name, m in zip(names, maps, strict=True):
                frame[name] = m[pos][:, qi, kj].reshape(-1).numpy()
            frames.append(pd.DataFrame(frame))
        return pd.concat(frames, ignore_index=True)

    # ---- files ---------------------------------------------------------------------
    def save(
        self,
        directory: str | Path,
        storage: str | torch.dtype | None = None,
        overwrite: bool = False,
    ) -> Path:
        """Write the trace as a folder (format 2, see module docstring).

        ``storage``: dtype of the maps on disk (default: the trace's own). A folder holds
        one trace: a folder that holds another is refused unless ``overwrite`` (then the
        earlier trace is replaced once the new one is complete, :mod:`.folder`), and a
        folder another process is writing is refused.
        """
        out = Path(directory)
        if self.path is not None and out.resolve() == self.path.resolve():
            with writer_lock(out):
                self._write_metadata(out)
            return out
        dtype = storage_dtype(storage or self.meta.get("storage_dtype", "float32"))
        with staged(out, TRACE_ENTRIES, overwrite) as stage:
            store = None
            if self.maps is not None:
                store = PackedMaps(
                    stage / "maps",
                    self.maps.names,
                    self.layers,
                    self.num_heads,
                    self.num_tokens,
                    dtype,
                )
                for pos in range(len(self.layers)):
                    stop = self.vectors.get("key_stop")
                    causal = True if stop is None else is_causal(stop[pos])
                    store.start_layer(pos, causal)
                    for name in self.maps.names:
                        for q0, block in self.iter_blocks(name, pos):
                            store.write(name, pos, slice(q0, q0 + block.shape[1]), block)
                    store.finish_layer(pos)
                store.close()
            meta = {**self.meta, "storage_dtype": dtype_name(dtype)}
            copy = Trace(**{**self.__dict__, "meta": meta, "path": stage})
            copy._write_metadata(stage, None if store is None else store.checksums)
        return out

    def _write_metadata(self, out: Path, checksums: dict[str, str] | None = None) -> None:
        """Everything but the maps (:func:`~.format.write_metadata`); ``checksums``: the
        shards' (default: those of this trace's own shards on disk)."""
        if checksums is None and self.maps is not None:
            checksums = self.maps.checksums
        meta = {
            **self.meta,
            "model": self.model_name,
            "layers": self.layers,
            "measures": self.measures,
            "num_heads": self.num_heads,
            "stored": self.maps.names if self.maps is not None else [],
            "maps": self.maps is not None,
        }
        write_metadata(
            out,
            input_ids=self.input_ids,
            tokens=self.tokens,
            vectors=self.vectors,
            reductions=self.reductions,
            meta=meta,
            summary=self.summary().to_dict(orient="index"),
            checksums=checksums,
        )

    def moved_to(self, folder: str | Path) -> None:
        """The trace's files now live in ``folder`` (moved there from a staging folder)."""
        self.path = Path(folder)
        if self.maps is not None:
            self.maps.moved(self.path / "maps")

    @classmethod
    def load(cls, directory: str | Path, verify: bool = False) -> Trace:
        """Open a trace folder lazily (maps are read when indexed).

        ``verify``: first check every file against the checksums recorded when the trace
        was written, and raise :class:`~.storage.TraceFileError` naming the damaged ones
        (without it, a whole layer read from disk is checked as it is read).
        """
        return cls(**read_folder(Path(directory), verify=verify))

    def __repr__(self) -> str:
        t = self.num_tokens
        shape = (len(self.layers), self.num_heads, t, t) if self.maps is not None else "no maps"
        return (
            f"Trace(model={self.model_name!r}, tokens={t}, "
            f"layers={len(self.layers)}, measures={self.measures}, shape={shape})"
        )
