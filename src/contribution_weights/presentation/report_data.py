"""The compact binary form of a trace that the HTML report embeds (pure numpy, no HTML).

A report stores, per measure, one *chunk* per embedded layer plus one chunk ``"mean"``
(the mean over all traced layers). A chunk holds ``K = H + 1`` query × key blocks: the
H heads, then their sum over heads. Only the lower triangle (key ≤ query) is kept, key
by key (a key's column of queries compresses better than rows do): block ``b``, query
``i``, key ``j ≤ i`` sits at ``b·N + jT − j(j−1)/2 + (i − j)`` with ``N = T(T+1)/2``.
Chunks are zlib-compressed (the page inflates them with the browser's
``DecompressionStream``) and base64-encoded.

Two precisions:

* ``"uint8"`` (default): per query row, ``scale = max_j |w_ij| / 255`` (``/ 127`` for a
  measure with negative values) is stored as float32, and each value as the nearest
  integer multiple of it (uint8, or int8 when signed). The error is at most ``scale / 2``,
  i.e. 1/510 (1/254) of the largest magnitude in that row of that block.
* ``"float16"``: each value rounded to IEEE half precision (relative error ≤ 2⁻¹¹ for
  |w| ≥ 6.1e-5, absolute error ≤ 2⁻²⁵ below; values beyond ±65504 are refused).

Layout of a decompressed chunk: ``uint8``: ``K·T`` float32 scales (block-major, one per
query row), then ``K·N`` codes;
``float16``: ``K·N`` float16. All little-endian.
"""

from __future__ import annotations

import base64
import json
import re
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from .page import json_script, page_text

PRECISIONS = ("uint8", "float16")
#: what a report embeds by default, and its size limit (here, not in report.py: the
#: command line shows them before importing torch)
DEFAULT_MEASURES = ("attention", "contribution", "intra", "vw", "vw_on", "distance")
DEFAULT_MAX_BYTES = 100 * 2**20  # SmolLM2, 512 tokens, 30 layers: 80.9 MiB
FLOAT16_MAX = 65504.0


def rounding_note(precision: str, signed_measures: list[str]) -> str:
    """One sentence for the page saying exactly what was rounded and by how much."""
    if precision == "uint8":
        signed = ", ".join(signed_measures) or "none"
        return (
            "The page rounds only the values it embeds; the trace itself is not rounded "
            "(the model ran with its weights as loaded). They are stored with 8 bits per "
            "value: "
            "in every row (one query, one layer, "
            "one head or the head sum) each value is rounded to the nearest multiple of "
            "max|row|/255 (max|row|/127 for measures with negative values: "
            f"{signed}), so the error is at most 1/510 (1/254) of the row's largest "
            "magnitude. Sums over heads and means over layers were computed from the exact "
            "float32 trace, then rounded the same way. Summary numbers are exact."
        )
    if precision == "float16":
        return (
            "The page rounds only the values it embeds; the trace itself is not rounded "
            "(the model ran with its weights as loaded). They are stored as IEEE float16 "
            "(about 3 "
            "significant digits: relative error "
            "at most 2^-11 ≈ 0.05%; absolute error at most 3e-8 for |w| < 6.1e-5). Sums over "
            "heads and means over layers were computed from the exact float32 trace, then "
            "rounded the same way. Summary numbers are exact."
        )
    raise ValueError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}")


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}")
    return precision


@lru_cache(maxsize=8)
def key_major_indices(t: int) -> tuple[np.ndarray, np.ndarray]:
    """``(query, key)`` index arrays of the lower triangle in storage order (key-major)."""
    kj, qi = np.triu_indices(t)  # key j, then queries i = j .. T-1
    return qi, kj


def key_offsets(t: int) -> np.ndarray:
    """Start of each key's run of queries within a block (length ``T + 1``)."""
    j = np.arange(t + 1)
    return j * t - j * (j - 1) // 2


def lower_triangle(blocks: np.ndarray) -> np.ndarray:
    """``(K, T, T)`` -> ``(K, T(T+1)/2)``: entries with key ≤ query, in storage order."""
    qi, kj = key_major_indices(blocks.shape[-1])
    return blocks[:, qi, kj]


def encode_chunk(blocks: np.ndarray, precision: str, signed: bool) -> bytes:
    """Quantise ``(K, T, T)`` blocks (lower triangle used) into a compressed chunk.

    Rounding happens once, from the given values (float64 sums stay float64 until then).
    """
    square = np.tril(np.asarray(blocks, dtype=np.float64))
    if not np.isfinite(square).all():
        raise ValueError("the trace holds NaN or infinite values; it cannot be embedded")
    if precision == "float16":
        peak = float(np.abs(square).max()) if square.size else 0.0
        if peak > FLOAT16_MAX:
            raise ValueError(
                f"a value of magnitude {peak:.3g} does not fit float16 (max 65504); "
                "use precision='uint8' (CLI: --precision uint8)"
            )
        raw = lower_triangle(square).astype("<f2").tobytes()
    elif precision == "uint8":
        levels = 127 if signed else 255
        scale = (np.abs(square).max(-1) / levels).astype(np.float32)  # (K, T): per query row
        step = scale.astype(np.float64)[..., None]
        codes = np.divide(square, step, out=np.zeros_like(square), where=step > 0)
        np.clip(np.rint(codes, out=codes), -levels if signed else 0, levels, out=codes)
        small = lower_triangle(codes).astype(np.int8 if signed else np.uint8)
        raw = scale.astype("<f4").tobytes() + small.tobytes()
    else:
        check_precision(precision)
        raise AssertionError  # unreachable
    return zlib.compress(raw, 6)


def decode_chunk(data: bytes, precision: str, signed: bool, k: int, t: int) -> np.ndarray:
    """Inverse of :func:`encode_chunk`: ``(K, T, T)`` float64, zeros above the diagonal."""
    raw = zlib.decompress(data)
    n = t * (t + 1) // 2
    qi, kj = key_major_indices(t)
    if precision == "float16":
        tri = np.frombuffer(raw, dtype="<f2", count=k * n).astype(np.float64).reshape(k, n)
    elif precision == "uint8":
        scale = np.frombuffer(raw, dtype="<f4", count=k * t).astype(np.float64).reshape(k, t)
        codes = np.frombuffer(raw, dtype=np.int8 if signed else np.uint8, offset=4 * k * t)
        tri = codes.reshape(k, n).astype(np.float64) * scale[:, qi]
    else:
        raise ValueError(f"unknown precision {precision!r}")
    out = np.zeros((k, t, t))
    out[:, qi, kj] = tri
    return out


def error_bound(blocks: np.ndarray, precision: str, signed: bool) -> np.ndarray:
    """``(K, T, T)``: the largest error the stated rounding allows at each position."""
    blocks = np.asarray(blocks, dtype=np.float64)
    if precision == "float16":
        return np.maximum(np.abs(blocks) * 2.0**-11, 2.0**-25)
    levels = 127 if signed else 255
    t = blocks.shape[-1]
    lower = np.tril(np.ones((t, t), dtype=bool))
    peak = np.where(lower, np.abs(blocks), 0).max(axis=-1, keepdims=True)
    # half a step of the stored (float32) scale; 1e-6 covers the scale's own rounding
    return np.broadcast_to(peak / levels * 0.5 * (1 + 1e-6), blocks.shape)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


@dataclass(frozen=True)
class ChunkInfo:
    """Where a chunk lives in the page and how to read it."""

    measure: str
    layer: str  # model layer index as text, or "mean"
    script_id: str
    compressed_bytes: int


def page_data(source: str | Path) -> tuple[dict[str, Any], dict[str, str]]:
    """A report page's metadata and its chunks (script id -> base64 text), from a path or
    the HTML text itself."""
    text = page_text(source)
    found = json_script(text, "cw-meta")
    if found is None:
        raise ValueError("this HTML holds no contribution-weights report data (no cw-meta)")
    blobs = re.findall(r'<script type="application/x-cw-chunk" id="([^"]+)">([^<]*)</script>', text)
    return json.loads(found), dict(blobs)
