"""Where a trace's ``T × T`` maps live: in memory, or on disk in per-layer shards.

A map store holds the *stored* measures (:func:`~.measures.registry.stored_measures`) of
the traced layers, written one block of queries at a time while the forward runs and read
back by (layer, heads, query range):

* :class:`DenseMaps`: one ``(L, H, T, T)`` tensor per measure in memory;
* :class:`PackedMaps`: one safetensors file per traced layer, ``maps/layer-NNN.safetensors``,
  holding per measure an ``(H, T(T+1)/2)`` tensor: the lower triangle of each head's map,
  row after row. A causal map is half zeros; packing them away halves the file without a
  compression codec, and a block of query rows is one contiguous byte range, so reading
  ``[l, h, q0:q1]`` touches only those bytes (safetensors slices a memory map). The file's
  header is written first and each block is written at its offset as soon as it is done,
  so peak memory is one block, whatever the length or the number of layers. Layers whose
  queries may attend to later keys (not causal) are stored whole (``layout: full``);
* :class:`LegacyMaps`: a ``trace.safetensors`` of the first file format (a dense
  ``(L, H, T, T)`` tensor per measure), read lazily too.

Docs: docs/long-contexts.md explains the choice with measured sizes and speeds.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from ..defaults import STORAGE_DTYPE_NAMES  # light: the CLI's choices
from .folder import TraceFileError, check_file, file_digest

STORAGE_DTYPES = {name: getattr(torch, name) for name in STORAGE_DTYPE_NAMES}
_ST_DTYPE = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
}


def storage_dtype(value: str | torch.dtype) -> torch.dtype:
    if isinstance(value, torch.dtype):
        if value in _ST_DTYPE:
            return value
    elif value in STORAGE_DTYPES:
        return STORAGE_DTYPES[value]
    raise ValueError(f"storage dtype must be one of {', '.join(STORAGE_DTYPES)}, not {value!r}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it
    (``/proc/self/status``); elsewhere set and restored at once."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_tensors(tensors: dict[str, Tensor], path: str | Path) -> Path:
    """``safetensors.torch.save_file`` with the mode ``open()`` gives a new file
    (0o666 & ~umask, usually 0644): save_file writes a temporary file and renames it,
    which leaves the file readable by its owner only (0600)."""
    from safetensors.torch import save_file

    path = Path(path)
    save_file(tensors, str(path))
    os.chmod(path, 0o666 & ~_umask())
    return path


def is_causal(key_stop: Tensor) -> bool:
    """Whether queries ``0 … n−1`` attend to no key after themselves (``key_stop`` holds
    one past the last key each may see): their rows fit the packed lower-triangle layout."""
    return bool((key_stop <= torch.arange(1, key_stop.numel() + 1, device=key_stop.device)).all())


def pack_rows(block: Tensor, first_query: int) -> Tensor:
    """``(H, I, ≥ q1)`` rows ``q0 … q1−1`` to ``(H, n)``: row q's keys 0 … q, row after row.

    One concatenation of row slices: several times faster than a boolean-mask gather.
    """
    i = block.shape[1]
    return torch.cat([block[:, r, : first_query + r + 1] for r in range(i)], dim=1)


def unpack_rows(packed: Tensor, first_query: int, rows: int, num_keys: int) -> Tensor:
    """Inverse of :func:`pack_rows`: ``(H, n)`` to ``(H, I, T)`` with zeros after each
    row's last key (padding the split rows: several times faster than a boolean-mask put)."""
    from torch.nn.utils.rnn import pad_sequence

    h = packed.shape[0]
    out = torch.zeros(h, rows, num_keys, dtype=packed.dtype)
    if rows == 0:
        return out
    lengths = [first_query + r + 1 for r in range(rows)]
    width = lengths[-1]
    for k in range(h):
        out[k, :, :width] = pad_sequence(list(torch.split(packed[k], lengths)), batch_first=True)
    return out


def packed_offset(row: int) -> int:
    """Index of row ``row``'s first entry in a packed lower triangle."""
    return row * (row + 1) // 2


class MapStore(Protocol):
    """Stored maps of the traced layers (see module docstring).

    A trace writes each layer as ``start_layer``, then blocks of query rows (each measure's
    block computed straight into ``destination`` where the store offers one, else handed
    to ``write``), then ``finish_layer``; callers never ask which store they hold.
    """

    names: list[str]
    #: files on disk -> digest (``maps/layer-NNN.safetensors``); empty for maps in memory
    checksums: dict[str, str]

    def start_layer(self, pos: int, causal: bool) -> None:
        """Layer ``pos`` begins; ``causal``: every query sees only keys up to itself."""
        ...

    def destination(
        self, name: str, pos: int, rows: slice, keys: slice, dtype: torch.dtype
    ) -> Tensor | None:
        """An ``(H, I, K)`` view to compute a block of ``dtype`` into (the rest of those rows
        set to zero), or None: compute it elsewhere and :meth:`write` it."""
        ...

    def write(self, name: str, pos: int, rows: slice, block: Tensor, first_key: int = 0) -> None:
        """Store ``block`` ``(H, I, K)``: rows ``rows`` of measure ``name`` at layer ``pos``,
        keys ``first_key … first_key + K − 1`` (the other keys of those rows are 0)."""
        ...

    def finish_layer(self, pos: int) -> None:
        """Every row of layer ``pos`` is written."""
        ...

    def read(self, name: str, pos: int, heads: slice, rows: slice) -> Tensor:
        """``(h, I, T)`` float32 (float64 for float64 storage): heads × query rows × keys."""
        ...

    def to(self, device: str) -> MapStore:
        """The maps on ``device`` (stores on disk stay where they are)."""
        ...

    def moved(self, folder: str | Path) -> MapStore:
        """The store's files now live in ``folder`` (a no-op for maps in memory)."""
        ...

    def close(self) -> None: ...


def _float(x: Tensor) -> Tensor:
    return x if x.dtype == torch.float64 else x.to(torch.float32)


class DenseMaps:
    """Stored maps in memory, one ``(L, H, T, T)`` tensor per measure."""

    def __init__(
        self,
        names: list[str],
        num_layers: int,
        num_heads: int,
        num_tokens: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.names = list(names)
        self.dtype = dtype
        self.checksums: dict[str, str] = {}
        shape = (num_layers, num_heads, num_tokens, num_tokens)
        # not zero-filled (a pass over gigabytes): each block zeroes the keys of its rows
        # that it does not cover (those its queries cannot see)
        self.tensors = {n: torch.empty(shape, dtype=dtype, device=device) for n in names}

    def start_layer(self, pos: int, causal: bool) -> None:
        pass

    def _view(self, name: str, pos: int, rows: slice, keys: slice) -> Tensor:
        full = self.tensors[name][pos, :, rows]
        full[..., : keys.start] = 0
        full[..., keys.stop :] = 0
        return full[..., keys]

    def destination(
        self, name: str, pos: int, rows: slice, keys: slice, dtype: torch.dtype
    ) -> Tensor | None:
        """The storage itself when it holds ``dtype`` (for ``out=`` writes, saving a copy)."""
        return self._view(name, pos, rows, keys) if dtype == self.dtype else None

    def write(self, name: str, pos: int, rows: slice, block: Tensor, first_key: int = 0) -> None:
        keys = slice(first_key, first_key + block.shape[-1])
        dest = self._view(name, pos, rows, keys)
        if block.data_ptr() != dest.data_ptr():
            dest.copy_(block)

    def finish_layer(self, pos: int) -> None:
        pass

    def read(self, name: str, pos: int, heads: slice, rows: slice) -> Tensor:
        return _float(self.tensors[name][pos, heads, rows])

    def to(self, device: str) -> DenseMaps:
        self.tensors = {k: v.to(device) for k, v in self.tensors.items()}
        return self

    def moved(self, folder: str | Path) -> DenseMaps:
        return self

    def close(self) -> None:
        pass


def _write_header(fh: Any, tensors: dict[str, tuple[torch.dtype, list[int]]], meta: dict) -> int:
    """Write a safetensors header for tensors of known dtype and shape; returns the data start."""
    header: dict[str, Any] = {"__metadata__": {k: str(v) for k, v in meta.items()}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = torch.empty((), dtype=dtype).element_size()
        for n in shape:
            size *= n
        header[name] = {
            "dtype": _ST_DTYPE[dtype],
            "shape": shape,
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    fh.write(struct.pack("<Q", len(raw)))
    fh.write(raw)
    start = 8 + len(raw)
    fh.truncate(start + offset)  # sparse until written
    return start


class PackedMaps:
    """Stored maps on disk: a packed lower-triangle safetensors shard per traced layer."""

    def __init__(
        self,
        folder: str | Path,
        names: list[str],
        layers: list[int],
        num_heads: int,
        num_tokens: int,
        dtype: torch.dtype,
        layouts: dict[int, str] | None = None,
        checksums: dict[str, str] | None = None,
    ) -> None:
        self.folder = Path(folder)
        # "maps/layer-NNN.safetensors" -> digest: recorded as each shard is finished when
        # writing; when reading, what meta.json recorded (a whole-layer read checks it)
        self.checksums: dict[str, str] = dict(checksums or {})
        self._checked: set[int] = set()
        self.names = list(names)
        self.layers = list(layers)
        self.num_heads = num_heads
        self.num_tokens = num_tokens
        self.dtype = dtype
        self.layouts: dict[int, str] = dict(layouts or {})
        self._fds: dict[int, int] = {}
        self._offsets: dict[int, dict[str, int]] = {}
        self._readers: dict[int, Any] = {}

    def path(self, pos: int) -> Path:
        return self.folder / f"layer-{self.layers[pos]:03d}.safetensors"

    def key(self, pos: int) -> str:
        """Layer ``pos``'s shard as the trace folder's checksums name it."""
        return f"{self.folder.name}/{self.path(pos).name}"

    def moved(self, folder: str | Path) -> PackedMaps:
        """The shards now live in ``folder`` (the trace was moved into place)."""
        self.close()
        self.folder = Path(folder)
        return self

    # ---- writing -----------------------------------------------------------------------
    def _open_for_write(self, pos: int, layout: str) -> int:
        self.folder.mkdir(parents=True, exist_ok=True)
        t, h = self.num_tokens, self.num_heads
        per_head = packed_offset(t) if layout == "tril" else t * t
        shape = [h, per_head] if layout == "tril" else [h, t, t]
        tensors = {name: (self.dtype, shape) for name in self.names}
        path = self.path(pos)
        with open(path, "wb") as fh:
            start = _write_header(
                fh, tensors, {"layout": layout, "num_tokens": t, "layer": self.layers[pos]}
            )
        size = torch.empty((), dtype=self.dtype).element_size()
        self._offsets[pos] = {
            name: start + k * h * per_head * size for k, name in enumerate(self.names)
        }
        self.layouts[pos] = layout
        fd = os.open(path, os.O_WRONLY)
        self._fds[pos] = fd
        return fd

    def start_layer(self, pos: int, causal: bool) -> None:
        """Create layer ``pos``'s shard (packed when every query sees only keys ≤ itself)."""
        if pos not in self._fds:
            self._open_for_write(pos, "tril" if causal else "full")

    def write(self, name: str, pos: int, rows: slice, block: Tensor, first_key: int = 0) -> None:
        if pos not in self._fds:
            self.start_layer(pos, causal=True)
        fd = self._fds[pos]
        h, i, k = block.shape
        t = self.num_tokens
        size = torch.empty((), dtype=self.dtype).element_size()
        tril = self.layouts[pos] == "tril"
        width = rows.stop if tril else t  # a packed row q holds keys 0 … q
        if first_key != 0 or k != width:
            full = torch.zeros(h, i, width, dtype=block.dtype, device=block.device)
            full[..., first_key : first_key + k] = block[..., : width - first_key]
            block = full
        if tril:
            data = pack_rows(block.to(self.dtype), rows.start)  # (H, packed entries)
            per_head, first = packed_offset(t), packed_offset(rows.start)
        else:
            data = block.to(self.dtype).reshape(h, i * t)
            per_head, first = t * t, rows.start * t
        data = data.cpu().contiguous()
        raw = data.view(torch.int16) if self.dtype == torch.bfloat16 else data
        array = raw.numpy()
        base = self._offsets[pos][name]
        for head in range(h):
            os.pwrite(
                fd, memoryview(array[head]).cast("B"), base + (head * per_head + first) * size
            )

    def destination(
        self, name: str, pos: int, rows: slice, keys: slice, dtype: torch.dtype
    ) -> Tensor | None:
        return None  # blocks are packed and written to the shard

    def finish_layer(self, pos: int) -> None:
        fd = self._fds.pop(pos, None)
        if fd is not None:
            os.close(fd)
            # read back at once, while the shard is in the page cache
            self.checksums[self.key(pos)] = file_digest(self.path(pos))
            self._checked.add(pos)

    def to(self, device: str) -> PackedMaps:
        return self  # on disk, read back by memory map

    # ---- reading -----------------------------------------------------------------------
    def _reader(self, pos: int) -> Any:
        if pos not in self._readers:
            from safetensors import safe_open

            path = self.path(pos)
            if not path.is_file():
                raise TraceFileError(f"{path} is missing: the trace folder is incomplete")
            try:
                handle = safe_open(str(path), framework="pt")
                layout = (handle.metadata() or {}).get("layout", "tril")
            except Exception as exc:  # safetensors raises its own error types
                raise TraceFileError(
                    f"{path} is not a readable safetensors file ({exc}); the trace was "
                    "interrupted or the file is damaged: trace the text again"
                ) from None
            self.layouts[pos] = layout
            self._readers[pos] = handle
        return self._readers[pos]

    def read(self, name: str, pos: int, heads: slice, rows: slice) -> Tensor:
        t = self.num_tokens
        start, stop, _ = rows.indices(t)  # clipped to the trace, as slicing a tensor would be
        rows = slice(start, max(start, stop))
        if (rows.start, rows.stop) == (0, t) and heads.indices(self.num_heads)[:2] == (
            0,
            self.num_heads,
        ):
            self.check(pos)  # a whole layer: check its shard first (once)
        handle = self._reader(pos)
        view = handle.get_slice(name)
        if self.layouts[pos] == "full":
            return _float(view[heads, rows, :])
        packed = view[heads, packed_offset(rows.start) : packed_offset(rows.stop)]
        return unpack_rows(_float(packed), rows.start, rows.stop - rows.start, t)

    def check(self, pos: int) -> None:
        """Raise :class:`TraceFileError` when layer ``pos``'s shard is not what the trace
        wrote (checked once per process; a shard without a recorded checksum passes)."""
        if pos in self._checked:
            return
        if self.path(pos).is_file():
            check_file(self.path(pos), self.checksums.get(self.key(pos)))
        self._checked.add(pos)

    def close(self) -> None:
        for pos in list(self._fds):
            self.finish_layer(pos)
        self._readers.clear()


class LegacyMaps:
    """The dense ``(L, H, T, T)`` tensors of a first-format ``trace.safetensors``."""

    def __init__(self, path: Path, names: list[str]) -> None:
        self.path = path
        self.names = list(names)
        self.checksums: dict[str, str] = {}
        self._handle: Any = None

    def _open(self) -> Any:
        if self._handle is None:
            from safetensors import safe_open

            self._handle = safe_open(str(self.path), framework="pt")
        return self._handle

    def start_layer(self, pos: int, causal: bool) -> None:
        raise TraceFileError(f"{self.path} is read-only")

    def destination(
        self, name: str, pos: int, rows: slice, keys: slice, dtype: torch.dtype
    ) -> Tensor | None:
        raise TraceFileError(f"{self.path} is read-only")

    def write(self, name: str, pos: int, rows: slice, block: Tensor, first_key: int = 0) -> None:
        raise TraceFileError(f"{self.path} is read-only")

    def finish_layer(self, pos: int) -> None:
        raise TraceFileError(f"{self.path} is read-only")

    def to(self, device: str) -> LegacyMaps:
        return self  # read from the file

    def moved(self, folder: str | Path) -> LegacyMaps:
        return self  # a first-format file is read, never written: it does not move

    def read(self, name: str, pos: int, heads: slice, rows: slice) -> Tensor:
        return _float(self._open().get_slice(name)[pos : pos + 1, heads, rows][0])

    def close(self) -> None:
        self._handle = None
