"""Timing shared by the benchmark scripts: the median of repeated calls after a warm-up."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def median_seconds(fn: Callable[[], Any], repeats: int = 5) -> float:
    """Median wall time of ``repeats`` calls of ``fn``, after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
