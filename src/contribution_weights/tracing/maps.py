"""A measure of a trace as an ``(L, H, T, T)`` array read on demand (:class:`MeasureMap`).

``trace["contribution"][l, h]`` or ``[l, h, q0:q1, k0:k1]`` reads only that part, from
memory or from disk; any torch operation on the whole map loads it whole first. A map
reads through its source (the :class:`~.result.Trace`), so it knows nothing of storage.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor


class MapSource(Protocol):
    """What a :class:`MeasureMap` reads from (a :class:`~.result.Trace`)."""

    layers: list[int]
    num_heads: int

    @property
    def num_tokens(self) -> int: ...

    @property
    def _read_dtype(self) -> torch.dtype: ...

    def _read(self, name: str, pos: int, heads: slice, rows: slice) -> Tensor: ...


class MeasureMap:
    """One measure of a trace as an ``(L, H, T, T)`` array read on demand.

    Index it with integers and slices (``[l]``, ``[l, h]``, ``[l, h, q0:q1, k0:k1]``,
    ``[..., 0]``): only the layers, heads and query rows asked for are read. Use
    :meth:`tensor` (or any torch function) for the whole map in memory.
    """

    def __init__(self, trace: MapSource, name: str) -> None:
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
            if index < 0:
                return msg
            count = getattr(self.trace, "meta", {}).get("num_layers")
            if isinstance(count, int) and index >= count:
                return msg + (
                    f" (the model has {count} layers, 0..{count - 1}: "
                    f"it has no layer {index} to trace)"
                )
            return msg + (
                f" (model layer {index} was not traced; trace it with layers=[..., {index}], "
                f"CLI --layers)"
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
