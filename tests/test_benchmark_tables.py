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


def test_full_context_table_is_what_its_runs_give():
    full = load_benchmark("full_context")
    assert (RESULTS / "bench-trace" / "full-context.md").read_text() == full.table()


def test_a_bench_trace_run_is_filed_one_file_per_result(tmp_path):
    full = load_benchmark("full_context")
    run = {
        "machine": "x86_64, 2 CPUs, torch threads: 1, Python 3.11.7, model smollm2",
        "results": [
            {"method": "sdpa", "tokens": 4096, "seconds": 10.0, "peak_mb": 100.0, "disk_mb": 0},
            {"method": "no-maps", "tokens": 4096, "seconds": 45.0, "peak_mb": 900.0},
            {"method": "eager", "tokens": 4096, "seconds": None, "error": "out of memory"},
        ],
    }
    (tmp_path / "run.json").write_text(json.dumps(run))
    written = full.add(tmp_path / "run.json", "nothing else running", folder=tmp_path)
    assert sorted(p.name for p in written) == [
        "smollm2-no-maps-4096.json",
        "smollm2-sdpa-4096.json",
    ]
    rows = full.table(tmp_path).splitlines()[2:]
    assert rows[0].startswith("| SmolLM2-135M | 4096 | sdpa") and "| 1.0 |" in rows[0]
    assert "| 45 | 4.5 | 900 |" in rows[1]
