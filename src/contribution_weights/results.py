"""The result object of a trace: maps, reductions, tokens and metadata, with save/load.

A :class:`Trace` describes one sequence through the traced layers (``layers`` lists them):

* ``trace[name]`` is a :class:`MeasureMap`, an ``(L, H, T, T)`` array read on demand:
  ``trace["contribution"][l, h]`` or ``[l, h, q0:q1, k0:k1]`` reads only that part (from
  memory, or from disk for a streamed or loaded trace); any torch operation on the whole
  map (``trace["contribution"].sum(-1)``) loads it whole first. Derived measures
  (``vw``, ``vw_on``, ``relative_norm``, ``ihc``) are computed from the stored maps and
  the per-layer norms as they are read (:mod:`.measures.registry`);
* reductions per (layer, head) (:mod:`.measures.reductions`: token scores, first-token
  weight, entropy, top-k keys) come from the forward for a trace without maps
  (``maps=False``) and are computed layer by layer from the maps otherwise;
* per-layer vectors: ``bias_share`` ``(L, T)``, the zero-denominator flags ``degenerate``
  ``(L, T)``, ``degenerate_heads`` and ``zero_values`` ``(L, H, T)``, and the norms the
  derived measures need (``value_norm`` ``(L, H, T)``, ``output_norm`` ``(L, T)``, the
  first and one-past-last key each query may attend to, ``key_start``/``key_stop``).

On disk a trace is a folder (format 2; folders of the first format, a single
``trace.safetensors``, still load):

* ``maps/layer-NNN.safetensors``: the stored maps of one model layer, packed lower
  triangles (:mod:`.storage`), absent for a trace without maps;
* ``vectors.safetensors``: ``input_ids`` and the per-layer vectors;
* ``reductions.safetensors``: the reductions, when they were computed in the forward;
* ``tokens.json`` (``{"ids": [...], "tokens": [...]}``), ``meta.json`` (model, layers,
  measures, stored maps, storage dtype) and ``summary.json`` (first-token weight and
  entropy per weight measure; strict JSON, ``null`` where a value is undefined).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import Tensor

from .measures.layer import Factors
from .measures.reductions import DEFAULT_TOP_K, MeasureReductions, ReductionAccumulator
from .measures.registry import get_measure
from .storage import (
    DenseMaps,
    LegacyMaps,
    MapStore,
    PackedMaps,
    TraceFileError,
    dtype_name,
    is_causal,
    storage_dtype,
)

FORMAT = 2
_READ_ELEMENTS = 1 << 25  # elements per block when reductions are computed from maps
# files a trace folder may hold; a new trace into a folder removes the ones it does not write
TRACE_FILES = (
    "trace.safetensors",
    "vectors.safetensors",
    "reductions.safetensors",
    "tokens.json",
    "meta.json",
    "summary.json",
    "heatmaps.png",
    "first_token_weight.png",
)
VECTOR_NAMES = (
    "bias_share",
    "degenerate",
    "degenerate_heads",
    "zero_values",
    "value_norm",
    "output_norm",
    "key_start",
    "key_stop",
)


class MeasureMap:
    """One measure of a trace as an ``(L, H, T, T)`` array read on demand.

    Index it with integers and slices (``[l]``, ``[l, h]``, ``[l, h, q0:q1, k0:k1]``,
    ``[..., 0]``): only the layers, heads and query rows asked for are read. Use
    :meth:`tensor` (or any torch function) for the whole map in memory.
    """

    def __init__(self, trace: Trace, name: str) -> None:
        self.trace = trace
        self.name = name

    @property
    def shape(self) -> torch.Size:
        t = self.trace.num_tokens
        return torch.Size((len(self.trace.layers), self.trace.num_heads, t, t))

    @property
    def ndim(self) -> int:
        return 4

    @property
    def dtype(self) -> torch.dtype:
        return self.trace._read_dtype

    def __len__(self) -> int:
        return len(self.trace.layers)

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def __getitem__(self, index: Any) -> Tensor:
        parts = _expand_index(index)
        dims = self.shape
        picked: list[range | int] = []
        for dim, (part, n) in enumerate(zip(parts, dims, strict=True)):
            if not isinstance(part, (int, slice)) or isinstance(part, bool):
                raise TypeError(
                    f"MeasureMap takes integers and slices (got {type(part).__name__}); "
                    "use .tensor() for the whole map, then index it freely"
                )
            if isinstance(part, int) and not -n <= part < n:
                raise IndexError(self._out_of_range(dim, part, n))
            picked.append(range(n)[part])
        layer_sel, head_sel, query_sel, key_sel = picked
        layers = [layer_sel] if isinstance(layer_sel, int) else list(layer_sel)
        heads = [head_sel] if isinstance(head_sel, int) else list(head_sel)
        queries = [query_sel] if isinstance(query_sel, int) else list(query_sel)
        keys = [key_sel] if isinstance(key_sel, int) else list(key_sel)
        out_shape = [
            len(x)
            for x, s in zip((layers, heads, queries, keys), picked, strict=False)
            if not isinstance(s, int)
        ]
        if not (layers and heads and queries and keys):
            return torch.zeros(out_shape, dtype=self.dtype)
        h0, h1 = min(heads), max(heads) + 1
        q0, q1 = min(queries), max(queries) + 1
        h_idx = torch.tensor(heads) - h0
        q_idx = torch.tensor(queries) - q0
        k_idx = torch.tensor(keys)
        blocks = []
        for pos in layers:
            box = self.trace._read(self.name, pos, slice(h0, h1), slice(q0, q1))
            blocks.append(box.index_select(0, h_idx).index_select(1, q_idx).index_select(2, k_idx))
        return torch.stack(blocks).reshape(out_shape)

    def _out_of_range(self, dim: int, index: int, n: int) -> str:
        """What is wrong with ``index`` on dimension ``dim`` (of size ``n``), and the fix."""
        valid = f"0..{n - 1}, or {-n}..-1 from the end" if n else "none"
        where = f"trace[{self.name!r}]"
        if dim == 0:
            layers = list(self.trace.layers)
            msg = (
                f"layer position {index} is out of range: {where} holds {n} traced layers, "
                f"positions {valid}; they are the model's layers {_layer_list(layers)}. "
                "The first index is a position in trace.layers, not a model layer index"
            )
            if index in layers:
                pos = layers.index(index)
                return msg + f": model layer {index} is {where}[{pos}]"
            return msg + (
                f" (model layer {index} was not traced; trace it with layers=[..., {index}], "
                f"CLI --layers)"
                if index >= 0
                else ""
            )
        if dim == 1:
            return (
                f"head {index} is out of range: {where} has {n} heads per layer, {valid}; "
                f"index as {where}[layer_position, head]"
            )
        what = "query" if dim == 2 else "key"
        return (
            f"{what} {index} is out of range: the trace holds {n} tokens, {valid} "
            "(len(trace.tokens))"
        )

    def layer(self, pos: int) -> Tensor:
        """``(H, T, T)``: traced layer ``pos`` (an index into ``trace.layers``)."""
        return self[pos]

    def tensor(self) -> Tensor:
        """The whole ``(L, H, T, T)`` map in memory."""
        return self[:]

    def numpy(self) -> Any:
        return self.tensor().numpy()

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        arr = self.tensor().numpy()
        return arr if dtype is None else arr.astype(dtype)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        def load(x: Any) -> Any:
            if isinstance(x, MeasureMap):
                return x.tensor()
            if isinstance(x, (list, tuple)):
                return type(x)(load(y) for y in x)
            return x

        return func(*load(args), **{k: load(v) for k, v in (kwargs or {}).items()})

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):
            raise AttributeError(attr)
        return getattr(self.tensor(), attr)

    def __repr__(self) -> str:
        return f"MeasureMap({self.name!r}, shape={tuple(self.shape)})"


def _tensor_op(op: str) -> Any:
    def method(self: MeasureMap, *args: Any) -> Any:
        loaded = [a.tensor() if isinstance(a, MeasureMap) else a for a in args]
        return getattr(self.tensor(), op)(*loaded)

    method.__name__ = op
    return method


# arithmetic and comparisons load the whole map, like any other torch operation
_OPS = (
    *("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__"),
    *("__rtruediv__", "__pow__", "__matmul__", "__rmatmul__", "__neg__", "__abs__"),
    *("__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__", "__iter__"),
)
for _op in _OPS:
    setattr(MeasureMap, _op, _tensor_op(_op))
MeasureMap.__hash__ = object.__hash__  # type: ignore[method-assign]


def _layer_list(layers: list[int]) -> str:
    """``0..29`` for a run of layers, else the list (shortened when long)."""
    if not layers:
        return "(none)"
    if layers == list(range(layers[0], layers[-1] + 1)) and len(layers) > 2:
        return f"{layers[0]}..{layers[-1]}"
    shown = [str(x) for x in layers]
    if len(shown) > 12:
        shown = [*shown[:5], "…", *shown[-5:]]
    return ", ".join(shown)


def _expand_index(index: Any) -> tuple[Any, ...]:
    parts = index if isinstance(index, tuple) else (index,)
    if sum(p is Ellipsis for p in parts) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if Ellipsis in [p for p in parts if not isinstance(p, Tensor)]:
        at = next(i for i, p in enumerate(parts) if p is Ellipsis)
        fill = (slice(None),) * (4 - (len(parts) - 1))
        parts = parts[:at] + fill + parts[at + 1 :]
    if len(parts) > 4:
        raise IndexError(f"too many indices for a (L, H, T, T) map: {len(parts)}")
    return tuple(parts) + (slice(None),) * (4 - len(parts))


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
    def __getitem__(self, name: str) -> MeasureMap:
        if name not in self.measures and (self.maps is None or name not in self.maps.names):
            raise KeyError(
                f"measure {name!r} was not traced; this trace has: {', '.join(self.measures)}"
            )
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

    def iter_blocks(self, name: str, pos: int) -> Iterator[tuple[int, Tensor]]:
        """``(first_query, (H, I, T))`` blocks of one layer's map, of bounded size."""
        t = self.num_tokens
        step = max(1, _READ_ELEMENTS // max(1, self.num_heads * t))
        for q0 in range(0, t, step):
            q1 = min(t, q0 + step)
            yield q0, self._read(name, pos, slice(0, self.num_heads), slice(q0, q1))

    # ---- reductions and aggregates --------------------------------------------------
    def reduced(self, name: str, top_k: int = DEFAULT_TOP_K) -> MeasureReductions:
        """The reductions of a measure (computed from the maps on first use if need be)."""
        if name not in self.measures:
            raise KeyError(
                f"measure {name!r} was not traced; this trace has: {', '.join(self.measures)}"
            )
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

    def token_scores(self, name: str) -> Tensor:
        """``(L, H, T)``: mean over queries i ≥ j of the measure (the faithfulness score)."""
        return self.reduced(name).token_scores()

    def first_token_weight(self, name: str) -> Tensor:
        """``(L,)``: per-layer first-token weight of the normalised measure."""
        return self.reduced(name).first_token_weight()

    def entropy(self, name: str, exclude_first: bool = False) -> float:
        """Mean over layers, heads and queries of the per-query entropy (paper Table 5)."""
        return self.reduced(name).mean_entropy(exclude_first)

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
    def save(self, directory: str | Path, storage: str | torch.dtype | None = None) -> Path:
        """Write the trace as a folder (format 2, see module docstring).

        ``storage``: dtype of the maps on disk (default: the trace's own). A folder holds
        one trace: files of an earlier trace there are removed first.
        """
        out = Path(directory)
        if self.path is not None and out.resolve() == self.path.resolve():
            write_metadata(self, out)
            return out
        dtype = storage_dtype(storage or self.meta.get("storage_dtype", "float32"))
        prepare_folder(out)
        if self.maps is not None:
            store = PackedMaps(
                out / "maps", self.maps.names, self.layers, self.num_heads, self.num_tokens, dtype
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
        copy = Trace(**{**self.__dict__, "meta": meta, "path": out})
        write_metadata(copy, out)
        return out

    @classmethod
    def load(cls, directory: str | Path) -> Trace:
        """Open a trace folder lazily (maps are read when indexed)."""
        return load_trace(Path(directory))

    # ---- interactive report (presentation layer, imported lazily) ---------------------
    def to_html(self, path: str | Path, **kwargs: Any) -> Path:
        """Write the interactive self-contained HTML report; see ``presentation.report``."""
        from .presentation.report import write_report

        return write_report(self, path, **kwargs).path  # type: ignore[return-value]

    def _repr_html_(self) -> str:
        from .presentation.report import notebook_html

        return notebook_html(self)

    def __repr__(self) -> str:
        t = self.num_tokens
        shape = (len(self.layers), self.num_heads, t, t) if self.maps is not None else "no maps"
        return (
            f"Trace(model={self.model_name!r}, tokens={t}, "
            f"layers={len(self.layers)}, measures={self.measures}, shape={shape})"
        )


# ---- folders ------------------------------------------------------------------------------
def prepare_folder(out: Path) -> None:
    """Make ``out`` an empty trace folder: create it, remove an earlier trace's files."""
    import shutil

    if out.exists() and not out.is_dir():
        raise TraceFileError(f"{out} is a file, not a folder; choose another output folder")
    out.mkdir(parents=True, exist_ok=True)
    for name in TRACE_FILES:
        (out / name).unlink(missing_ok=True)
    if (out / "maps").is_dir():
        shutil.rmtree(out / "maps")


def trace_files(folder: str | Path) -> list[str]:
    """The trace files ``folder`` holds (``"maps/"`` for the shards), read from the disk:
    after :func:`prepare_folder` and a trace, exactly the files that trace wrote."""
    folder = Path(folder)
    found = ["maps/"] if (folder / "maps").is_dir() else []
    return found + [name for name in TRACE_FILES if (folder / name).is_file()]


def _strict(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strict(v) for v in value]
    return value


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_strict(obj), indent=2, allow_nan=False))
    tmp.replace(path)


def write_metadata(trace: Trace, out: Path) -> None:
    """Write everything but the maps: vectors, reductions, tokens, meta, summary."""
    from .storage import save_tensors  # save_file's 0600 made the usual 0o666 & ~umask

    vectors = {k: _savable(v) for k, v in trace.vectors.items()}
    vectors["input_ids"] = trace.input_ids.to(torch.int64).contiguous()
    save_tensors(vectors, out / "vectors.safetensors")
    if trace.reductions:
        tensors: dict[str, Tensor] = {}
        seen: set[int] = set()
        for r in trace.reductions.values():
            for k, v in r.tensors().items():
                v = v.contiguous()
                # shared tensors (vw_on's top keys are vw's) are written as copies
                tensors[k] = v.clone() if v.data_ptr() in seen else v
                seen.add(v.data_ptr())
        save_tensors(tensors, out / "reductions.safetensors")
    write_json(out / "tokens.json", {"ids": trace.input_ids.tolist(), "tokens": trace.tokens})
    meta = {
        **trace.meta,
        "format": FORMAT,
        "model": trace.model_name,
        "layers": trace.layers,
        "measures": trace.measures,
        "num_heads": trace.num_heads,
        "stored": trace.maps.names if trace.maps is not None else [],
        "maps": trace.maps is not None,
    }
    write_json(out / "meta.json", meta)
    summary = trace.summary()
    write_json(out / "summary.json", summary.to_dict(orient="index"))


def _savable(x: Tensor) -> Tensor:
    return (x.to(torch.uint8) if x.dtype == torch.bool else x).contiguous().cpu()


def _read_json(path: Path, what: str) -> Any:
    if not path.is_file():
        raise TraceFileError(f"{path} is missing; a trace folder holds {what}")
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceFileError(f"{path} is not valid JSON ({exc}); trace the text again") from None


def _read_tensors(path: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    if not path.is_file():
        raise TraceFileError(f"{path} is missing: the trace folder is incomplete")
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types
        raise TraceFileError(
            f"{path} is not a readable safetensors file ({exc}); it may be truncated by an "
            "interrupted write: trace the text again"
        ) from None


def load_trace(folder: Path) -> Trace:
    if not folder.is_dir():
        raise TraceFileError(f"{folder} is not a folder; pass the folder a trace was written to")
    legacy = folder / "trace.safetensors"
    if not (folder / "meta.json").exists() and not legacy.exists():
        raise TraceFileError(f"{folder} holds no trace (no meta.json); is it a trace folder?")
    meta = _read_json(folder / "meta.json", "meta.json, tokens.json and the tensors")
    tokens = _read_json(folder / "tokens.json", "tokens.json with the ids and tokens")
    if not isinstance(tokens, dict) or not isinstance(tokens.get("tokens"), list):
        raise TraceFileError(f"{folder / 'tokens.json'} has no 'tokens' list")
    if not isinstance(meta, dict) or "layers" not in meta or "measures" not in meta:
        raise TraceFileError(f"{folder / 'meta.json'} lacks 'layers' or 'measures'")
    if meta.get("format", 1) >= 2:
        vectors = _read_tensors(folder / "vectors.safetensors")
        maps: MapStore | None = None
        heads = int(meta["num_heads"])
        t = int(vectors["input_ids"].numel())
        if meta.get("maps", True):
            maps = PackedMaps(
                folder / "maps",
                list(meta["stored"]),
                list(meta["layers"]),
                heads,
                t,
                storage_dtype(meta.get("storage_dtype", "float32")),
            )
            for pos in range(len(meta["layers"])):
                if not maps.path(pos).is_file():
                    raise TraceFileError(
                        f"{maps.path(pos)} is missing: the trace folder is incomplete "
                        "(an interrupted trace?); trace the text again"
                    )
        reductions: dict[str, MeasureReductions] = {}
        if (folder / "reductions.safetensors").exists():
            red = _read_tensors(folder / "reductions.safetensors")
            for name in meta["measures"]:
                if f"{name}.token_sums" in red:
                    reductions[name] = MeasureReductions.from_tensors(name, red)
    else:
        raw = _read_tensors(legacy)
        missing = [m for m in meta["measures"] if m not in raw]
        if missing:
            raise TraceFileError(f"{legacy} lacks the measures {missing} that meta.json lists")
        vectors = {k: v for k, v in raw.items() if k not in meta["measures"]}
        heads = int(raw[meta["measures"][0]].shape[1])
        t = int(vectors["input_ids"].numel())
        maps = LegacyMaps(legacy, list(meta["measures"]))
        reductions = {}
    ids = vectors.pop("input_ids")
    for flag in ("degenerate", "degenerate_heads", "zero_values"):
        if flag in vectors:
            vectors[flag] = vectors[flag].bool()
    if len(tokens["tokens"]) != t or tokens.get("ids", ids.tolist()) != ids.tolist():
        raise TraceFileError(
            f"{folder / 'tokens.json'} does not match the tensors: it has "
            f"{len(tokens['tokens'])} tokens, the trace {t}; the folder mixes two traces: "
            "trace the text again into an empty folder"
        )
    for name, v in vectors.items():
        if v.shape[0] != len(meta["layers"]) or v.shape[-1] != t:
            raise TraceFileError(
                f"{name} in {folder} has shape {tuple(v.shape)}, not ({len(meta['layers'])}, …, "
                f"{t}): the folder mixes two traces; trace the text again into an empty folder"
            )
    known = ("model", "layers", "measures", "num_heads", "stored", "maps", "format")
    return Trace(
        input_ids=ids,
        tokens=list(tokens["tokens"]),
        layers=list(meta["layers"]),
        measures=list(meta["measures"]),
        num_heads=heads,
        vectors=vectors,
        maps=maps,
        reductions=reductions,
        model_name=meta.get("model", ""),
        meta={k: v for k, v in meta.items() if k not in known},
        path=folder,
    )
