"""The report's view of a long trace: per-token heat over the whole text, and the maps of a
window of queries, in a page whose size grows linearly with the text, not with its square.

Past :data:`LONG_VIEW_TOKENS` tokens the full view (every ``T × T`` map, :mod:`.report`)
no longer fits a page: its size and the work to build it grow as T². This view embeds,
per measure and embedded layer, one compressed *chunk* of:

* ``scores`` ``(H + 1, T)``: each key's token score s_j (mean over queries i ≥ j of w_ij),
  per head and summed over heads;
* ``first`` ``(H + 1, T)``: each query's weight on token 0 after the measure's
  normalisation (per head, and summed over heads: the query's first-token weight);
* ``sources`` ``(H, T, k)``: each query's ``k`` keys of largest |w| per head (3, or 2
  beyond :data:`FEWER_SOURCES_TOKENS` tokens), as distances back from the query, with
  their weights relative to the largest;
* ``window`` ``(W, B)``: the rows of a window of ``W`` queries (default the last
  :data:`DEFAULT_WINDOW`), summed over heads, over every key, keys summed in ``B`` equal
  bins (``B = min(T, KEY_BINS)``; exact when ``T ≤ KEY_BINS``).

Everything but the window comes from the trace's reductions (computed in the forward for
a streamed trace, else from the maps block by block), so a trace without maps has this
view too, without its window. The window reads only its rows of each layer: no step holds
a whole layer. Values are stored as 8-bit codes scaled per row (per (head) for scores and
first-token weights, per query for the window), as the full view does: the error is at
most 1/510 (1/254 for signed values) of the row's largest magnitude.

Layout of a decompressed chunk (little-endian): float32 scales of ``scores`` (H+1),
``first`` (H+1) and ``window`` (W); then the codes, uint8 or int8 (signed measures):
``scores`` (H+1)·T, ``first`` (H+1)·T, ``window`` W·B; then the source weights ``(k, H,
T)`` (slot-major), each the weight over the query's largest |weight| times 127 (int8,
whatever the measure's sign); then the source distances ``(k, H, T)``, 2 bytes each
(``T ≤ 65535``, 65535 for an empty slot; else 4 bytes, 0xFFFFFFFF), stored byte plane by
byte plane (all low bytes, then all high bytes): distances are small and alike from one
query to the next, and split this way they compress about 15% better.
"""

from __future__ import annotations

import html
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..measures.aggregates import normalised
from ..progress import bar
from .page import CHUNK_TAG, REPORT_CSP, asset, estimate_bytes, fill, json_for_script, styles
from .report_data import b64, page_data

if TYPE_CHECKING:
    from ..tracing.result import Trace

#: above this many tokens ``view="auto"`` gives the long view
LONG_VIEW_TOKENS = 1024
DEFAULT_WINDOW = 128
KEY_BINS = 1024
SOURCES_K = 3
#: from this many tokens 2 sources per head and query, not 3: the sources are most of the
#: page (an 8,192-token SmolLM2 page of attention and contribution, all 30 layers: 29.5 MiB
#: with 3, 19.5 MiB with 2)
FEWER_SOURCES_TOKENS = 4096


def sources_k(num_tokens: int) -> int:
    """Top sources embedded per head and query."""
    return SOURCES_K if num_tokens <= FEWER_SOURCES_TOKENS else SOURCES_K - 1


LONG_MAX_BYTES = 20 * 2**20


def quantise_rows(x: np.ndarray, signed: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(R, C)`` -> float32 scales ``(R,)`` and codes (int8 when ``signed``, else uint8):
    each value the nearest multiple of ``max|row| / 127`` (``/ 255``)."""
    x = np.asarray(x, dtype=np.float64)
    levels = 127 if signed else 255
    scale = (np.abs(x).max(-1) / levels if x.size else np.zeros(x.shape[:-1])).astype(np.float32)
    step = scale.astype(np.float64)[..., None]
    codes = np.divide(x, step, out=np.zeros_like(x), where=step > 0)
    np.clip(np.rint(codes, out=codes), -levels if signed else 0, levels, out=codes)
    return scale, codes.astype(np.int8 if signed else np.uint8)


def key_bins(t: int) -> np.ndarray:
    """Start of each of the ``min(t, KEY_BINS)`` equal key bins."""
    return np.linspace(0, t, min(t, KEY_BINS) + 1).astype(np.int64)[:-1]


@dataclass
class LongChunk:
    """The decoded content of one chunk (see module docstring); ``window`` is ``(0, B)``
    for a trace without maps."""

    scores: np.ndarray  # (H+1, T)
    first: np.ndarray  # (H+1, T)
    window: np.ndarray  # (W, B)
    source_keys: np.ndarray  # (H, T, k), -1: empty
    source_weights: np.ndarray  # (H, T, k), relative to the query's largest |w|


def _planes(x: np.ndarray) -> bytes:
    """The bytes of ``x`` byte plane by byte plane (little-endian: low bytes first)."""
    raw = np.ascontiguousarray(x).view(np.uint8).reshape(-1, x.dtype.itemsize)
    return np.ascontiguousarray(raw.T).tobytes()


def encode_long_chunk(chunk: LongChunk, signed: bool) -> bytes:
    t = chunk.scores.shape[-1]
    s_scale, s_codes = quantise_rows(chunk.scores, signed)
    f_scale, f_codes = quantise_rows(chunk.first, signed)
    w_scale, w_codes = quantise_rows(chunk.window, signed)
    wide = t > 65535
    empty = 0xFFFFFFFF if wide else 0xFFFF
    queries = np.arange(t)[None, :, None]
    dist = np.where(chunk.source_keys < 0, empty, queries - chunk.source_keys)
    dist = dist.transpose(2, 0, 1).astype("<u4" if wide else "<u2")  # (k, H, T)
    rel = np.clip(np.rint(chunk.source_weights * 127), -127, 127).astype(np.int8)
    parts = [
        s_scale.astype("<f4").tobytes(),
        f_scale.astype("<f4").tobytes(),
        w_scale.astype("<f4").tobytes(),
        s_codes.tobytes(),
        f_codes.tobytes(),
        w_codes.tobytes(),
        np.ascontiguousarray(rel.transpose(2, 0, 1)).tobytes(),
        _planes(dist),
    ]
    return zlib.compress(b"".join(parts), 6)


def decode_long_chunk(
    data: bytes, signed: bool, heads: int, t: int, window: int, k: int
) -> LongChunk:
    """Inverse of :func:`encode_long_chunk`, to float64 (tests and :func:`read_long_report`)."""
    raw = zlib.decompress(data)
    b = len(key_bins(t)) if window else 0
    kk, off = heads + 1, 0

    def take(dtype: str, count: int) -> np.ndarray:
        nonlocal off
        out = np.frombuffer(raw, dtype=dtype, count=count, offset=off)
        off += out.nbytes
        return out

    s_scale, f_scale, w_scale = take("<f4", kk), take("<f4", kk), take("<f4", window)
    code = "i1" if signed else "u1"
    scores = take(code, kk * t).reshape(kk, t) * s_scale.astype(np.float64)[:, None]
    first = take(code, kk * t).reshape(kk, t) * f_scale.astype(np.float64)[:, None]
    win = take(code, window * b).reshape(window, b) * w_scale.astype(np.float64)[:, None]
    rel = take("i1", k * heads * t).reshape(k, heads, t).transpose(1, 2, 0) / 127.0
    wide = t > 65535
    size = 4 if wide else 2
    planes = take("u1", size * k * heads * t).reshape(size, -1)
    dist = sum(planes[p].astype(np.int64) << (8 * p) for p in range(size))
    dist = np.asarray(dist).reshape(k, heads, t).transpose(1, 2, 0)
    empty = 0xFFFFFFFF if wide else 0xFFFF
    keys = np.where(dist == empty, -1, np.arange(t)[None, :, None] - dist)
    return LongChunk(scores, first, win, keys, rel)


def first_weights(trace: Trace, name: str) -> torch.Tensor:
    """``(L, H, T)``: each query's weight on token 0, per head, after the measure's
    normalisation (summed over heads: the query's first-token weight)."""
    r = trace.kept_reductions(name)
    folded = torch.stack([r.first, r.row_sum - r.first], dim=-1).double()
    return normalised(folded, name)[..., 0]


def window_rows(trace: Trace, name: str, pos: int, window: tuple[int, int]) -> np.ndarray:
    """``(W, B)``: the window's query rows of one layer, summed over heads, keys binned."""
    q0, q1 = window
    total = np.zeros((q1 - q0, trace.num_tokens))
    for h in range(trace.num_heads):  # a head's rows at a time: never a whole layer
        total += trace[name][pos, h, q0:q1].double().numpy()
    return np.add.reduceat(total, key_bins(trace.num_tokens), axis=1)


@dataclass
class MeasureViews:
    """One measure's per-token arrays over every traced layer, read once for all chunks."""

    scores: np.ndarray  # (L, H, T) token scores
    first: np.ndarray  # (L, H, T) each query's normalised weight on token 0
    source_values: np.ndarray  # (L, H, T, k)
    source_keys: np.ndarray  # (L, H, T, k), -1: empty

    @classmethod
    def of(cls, trace: Trace, name: str, k: int) -> MeasureViews:
        if k > 0:
            values, keys = trace.top_k(name, k)
            vals, top = values.double().numpy(), keys.long().numpy()
        else:  # a trace without maps that kept no top-k keys
            shape = (len(trace.layers), trace.num_heads, trace.num_tokens, 0)
            vals, top = np.zeros(shape), np.zeros(shape, dtype=np.int64)
        return cls(
            scores=trace.token_scores(name).double().numpy(),
            first=first_weights(trace, name).numpy(),
            source_values=vals,
            source_keys=top,
        )


def layer_chunk(
    trace: Trace,
    name: str,
    pos: int,
    window: tuple[int, int] | None,
    views: MeasureViews,
) -> LongChunk:
    """The long view's data for one (measure, traced layer)."""
    scores, first, vals = views.scores[pos], views.first[pos], views.source_values[pos]
    peak = np.abs(vals[..., :1])
    rel = np.divide(vals, peak, out=np.zeros_like(vals), where=peak > 0)
    bins = len(key_bins(trace.num_tokens))
    win = np.zeros((0, bins)) if window is None else window_rows(trace, name, pos, window)
    return LongChunk(
        scores=np.concatenate([scores, scores.sum(0, keepdims=True)]),
        first=np.concatenate([first, first.sum(0, keepdims=True)]),
        window=win,
        source_keys=views.source_keys[pos],
        source_weights=rel,
    )


def resolve_window(trace: Trace, window: tuple[int, int] | None) -> tuple[int, int] | None:
    """The queries whose maps are embedded: ``window`` checked, or the last
    :data:`DEFAULT_WINDOW`; None for a trace without maps."""
    if not trace.has_maps:
        return None
    t = trace.num_tokens
    if window is None:
        return max(0, t - DEFAULT_WINDOW), t
    q0, q1 = (int(x) for x in window)
    if not 0 <= q0 < q1 <= t:
        raise ValueError(
            f"window {q0}:{q1} is not a range of queries of this trace (0 ≤ start < stop ≤ "
            f"{t}); e.g. window=({max(0, t - DEFAULT_WINDOW)}, {t}), CLI --window "
            f"{max(0, t - DEFAULT_WINDOW)}:{t}"
        )
    return q0, q1


def render_long(meta: dict[str, Any], chunks: dict[str, str], title: str) -> str:
    parts = {
        "__CW_CSP__": REPORT_CSP,
        "__CW_TITLE__": html.escape(title),
        "/*__CW_CSS__*/": styles("report.css", "long_report.css"),
        "//__CW_JS__": "\n".join(
            asset(n) for n in ("report_data.js", "report_chart.js", "long_report.js")
        ),
        "__CW_META__": json_for_script(meta),
        "<!--__CW_CHUNKS__-->": "".join(
            CHUNK_TAG.format(id=cid, data=text) for cid, text in chunks.items()
        ),
    }
    return fill("long_report.html", parts)


class LongEncoder:
    """Chunks of the long view, each encoded on first use (layers left out for size are
    never read)."""

    def __init__(
        self,
        trace: Trace,
        names: list[str],
        window: tuple[int, int] | None,
        k: int,
        signed: dict[str, bool],
        progress: bool,
        total: int,
    ) -> None:
        self.trace, self.names, self.window, self.k, self.signed = (
            trace,
            names,
            window,
            k,
            signed,
        )
        self._chunks: dict[int, dict[str, str]] = {}
        self._views: dict[str, MeasureViews] = {}
        self.bar = bar(total=total, desc="report: encoding", unit="layer", disable=not progress)

    def views(self, name: str) -> MeasureViews:
        if name not in self._views:
            self._views[name] = MeasureViews.of(self.trace, name, self.k)
        return self._views[name]

    def layer(self, layer: int) -> dict[str, str]:
        """``script id -> base64 chunk`` of every measure at a model layer."""
        if layer not in self._chunks:
            pos = self.trace.layer_position(layer)
            out = {}
            for m, name in enumerate(self.names):
                chunk = layer_chunk(self.trace, name, pos, self.window, self.views(name))
                out[f"cw-l{m}-{layer}"] = b64(encode_long_chunk(chunk, self.signed[name]))
            if self.trace.maps is not None:
                # drop the shards' memory maps: the window's pages of every layer would
                # otherwise stay mapped (about 40 MB a layer of SmolLM2 at 8,192 tokens)
                self.trace.maps.close()
            self._chunks[layer] = out
            self.bar.update()
        return self._chunks[layer]

    def layer_bytes(self, layer: int) -> int:
        """Exact bytes a layer adds to the page (encodes it if needed)."""
        return sum(len(CHUNK_TAG) + len(i) + len(t) for i, t in self.layer(layer).items())

    def estimate(self, layers: list[int]) -> float:
        return estimate_bytes(self.layer_bytes, list(self._chunks), layers)

    def close(self) -> None:
        self.bar.total = self.bar.n
        self.bar.refresh()
        self.bar.close()


def read_long_report(source: str | Any) -> tuple[dict[str, Any], dict[tuple[str, int], LongChunk]]:
    """The metadata and decoded chunks of a long-view page (a path, or its HTML text)."""
    import base64

    meta, blobs = page_data(source)
    if meta.get("view") != "long":
        raise ValueError("this report is not a long view; read it with read_report")
    window = 0 if meta["window"] is None else meta["window"][1] - meta["window"][0]
    chunks = {}
    for m, name in enumerate(meta["measure_order"]):
        for layer in meta["layers"]:
            raw = base64.b64decode(blobs[f"cw-l{m}-{layer}"])
            signed = meta["measures"][name]["signed"]
            chunks[(name, layer)] = decode_long_chunk(
                raw, signed, meta["num_heads"], meta["num_tokens"], window, meta["sources_k"]
            )
    return meta, chunks
