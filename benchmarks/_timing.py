"""Shared by the benchmark scripts: timing (the median of repeated calls after a warm-up)
and where the evaluation data are."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def median_seconds(fn: Callable[[], Any], repeats: int = 5) -> float:
    """Median wall time of ``repeats`` calls of ``fn``, after one untimed warm-up call."""
    return interleaved_medians({"fn": fn}, repeats)["fn"]


def interleaved_medians(fns: dict[str, Callable[[], Any]], repeats: int = 5) -> dict[str, float]:
    """Median wall time of each of ``fns``, timed in rounds (one call of each per round).

    Each function gets one untimed warm-up call first. Interleaving the variants puts any
    drift in the machine's load (other jobs, frequency changes) on all of them alike,
    so their ratios stay meaningful where back-to-back blocks of repeats would not.
    """
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def data_dir() -> Path:
    """The evaluation data folder the benchmarks read (``$CW_DATA_DIR``), or an exit that
    says how to set it."""
    value = os.environ.get("CW_DATA_DIR")
    if not value or not Path(value).is_dir():
        raise SystemExit(
            "this benchmark reads the evaluation data sets: set CW_DATA_DIR to their folder "
            "(laid out as docs/method.md, 'Evaluation data', describes)"
            + (f"; {value} is not a folder" if value else "")
        )
    return Path(value)


def plain_models(model_dir: str) -> dict[str, Any]:
    """The dequantised model folder loaded with plain transformers, float32, in eval mode,
    once per attention implementation (``eager``, ``sdpa``): the kvpress environment's
    side of the cross-checks."""
    import torch
    from transformers import AutoModelForCausalLM

    return {
        impl: AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation=impl
        ).eval()
        for impl in ("eager", "sdpa")
    }
