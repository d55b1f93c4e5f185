"""The full view's data: each measure's chunks (:class:`FullEncoder`, encoded on first
use) and the metadata the page shows for a measure."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..measures.registry import get_measure
from ..progress import bar
from .page import CHUNK_TAG, estimate_bytes
from .report_data import ChunkInfo, b64, encode_chunk

if TYPE_CHECKING:
    from ..tracing.result import Trace


def declared_signed(name: str) -> bool:
    """Whether the measure ``name`` is registered as signed (False for an unknown one)."""
    try:
        return bool(get_measure(name).signed)
    except ValueError:
        return False


def measure_meta(name: str, signed: bool) -> dict[str, Any]:
    """What the page shows of a measure: its description, sign and kind."""
    try:
        m = get_measure(name)
        return {"description": m.description, "signed": signed, "weight": m.is_weight}
    except ValueError:
        return {"description": name, "signed": signed, "weight": False}


class FullEncoder:
    """The chunks of a report, each encoded on first use, so that most layers left out
    for size are never encoded (the mean-over-layers chunks are always needed).

    Maps are read one (layer, head) at a time, ``trace[name][layer_pos, head]``, so a
    trace whose tensors stay on disk is never loaded whole."""

    def __init__(
        self, trace: Trace, names: list[str], precision: str, progress: bool, n_layers: int
    ):
        self.trace, self.names, self.precision = trace, names, precision
        self.num_heads = trace.num_heads
        traced = len(trace.layers)
        self.bar = bar(
            total=len(names) * (traced + n_layers + 1),
            desc="report: encoding",
            unit="step",
            disable=not progress,
        )
        self._layers: dict[int, list[tuple[ChunkInfo, str]]] = {}
        self.signed: dict[str, bool] = {}
        sums = {}
        for name in names:  # one pass over every traced layer: signs and the layer mean
            total: np.ndarray | None = None
            negative = False
            for pos in range(traced):
                block = self.block(name, pos)
                negative = negative or bool((block < 0).any())
                total = block.astype(np.float64) if total is None else total + block
                self.bar.update()
            self.signed[name] = declared_signed(name) or negative
            sums[name] = total
        self.mean_chunks = []
        for k, name in enumerate(names):
            total = sums.pop(name)
            assert total is not None
            mean = np.concatenate([total / traced, total.sum(0, keepdims=True) / traced])
            self.mean_chunks.append(self._chunk(k, name, "mean", mean))

    def block(self, name: str, pos: int) -> np.ndarray:
        """``(H, T, T)`` float32 of one traced layer, read head by head."""
        values = self.trace[name]
        return np.stack(
            [
                values[pos, h].detach().to("cpu", torch.float32).numpy()
                for h in range(self.num_heads)
            ]
        )

    def _chunk(self, k: int, name: str, layer: str, blocks: np.ndarray) -> tuple[ChunkInfo, str]:
        text = b64(encode_chunk(blocks, self.precision, self.signed[name]))
        self.bar.update()
        return ChunkInfo(name, layer, f"cw-c{k}-{layer}", len(text)), text

    def layer(self, layer: int) -> list[tuple[ChunkInfo, str]]:
        """One chunk per measure for a model layer: its H heads and their sum."""
        if layer not in self._layers:
            pos = self.trace.layer_position(layer)
            chunks = []
            for k, name in enumerate(self.names):
                block = self.block(name, pos)
                blocks = np.concatenate([block, block.sum(0, keepdims=True, dtype=np.float64)])
                chunks.append(self._chunk(k, name, str(layer), blocks))
            self._layers[layer] = chunks
        return self._layers[layer]

    def layer_bytes(self, layer: int) -> int:
        """Exact bytes a layer adds to the page (encodes it if needed)."""
        return sum(
            len(CHUNK_TAG) + len(info.script_id) + info.compressed_bytes
            for info, _ in self.layer(layer)
        )

    def estimate(self, layers: list[int]) -> float:
        return estimate_bytes(self.layer_bytes, list(self._layers), layers)

    def close(self) -> None:
        self.bar.total = self.bar.n  # layers left out were never encoded
        self.bar.refresh()
        self.bar.close()
