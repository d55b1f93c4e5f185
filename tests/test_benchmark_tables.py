"""The benchmarks' committed Markdown tables are what their committed results give."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmark_scripts import load_benchmark

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
KERNELS = sorted((RESULTS / "bench-trace").glob("kernels-*.json"))


@pytest.mark.parametrize("results", KERNELS, ids=[p.stem for p in KERNELS])
def test_compiled_kernel_tables_are_what_their_results_give(results: Path):
    tables = load_benchmark("bench_kernels").markdown(json.loads(results.read_text()))
    assert results.with_suffix(".md").read_text() == tables


def test_kernel_tables_show_a_profile_only_where_one_was_recorded():
    bench = load_benchmark("bench_kernels")
    result = json.loads((RESULTS / "bench-trace" / "kernels-profile-smollm2-2048.json").read_text())
    assert "| whole `_reduce` | 3.12 | 3.46 |" in bench.markdown(result)
    for row in result["rows"]:
        del row["profile"]
    assert "_reduce" not in bench.markdown(result)
