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


def test_default_method_table_is_what_the_runs_give():
    default = load_benchmark("attribution_default")
    assert (RESULTS / "attribution-default" / "default.md").read_text() == default.default_table()


def test_default_table_names_who_beats_a_method(tmp_path):
    """A top-1 below a better method names it; a tie with the best says so; a curve cell
    counts the rates at which nothing is better."""
    default = load_benchmark("attribution_default")
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.csv").write_text("measure,top1\ndirect,0.9\nflow,0.5\nablation,0.95\n")
    (run / "hits_paired.csv").write_text(
        "reference,other,verdict\nflow,direct,other better\nflow,ablation,other better\n"
        "direct,ablation,tie\ndirect,flow,reference better\n"
    )
    assert default.known_cell(run, "direct") == "0.90 tied"
    assert default.known_cell(run, "flow") == "0.50 < ablation, direct"
    assert default.known_cell(run, "ablation") == "–"  # no paired tests of its own
    (run / "paired.csv").write_text(
        "intervention,mode,rate,reference,other,verdict\n"
        "key_mask,sufficiency,0.1,direct,ablation,other better\n"
        "key_mask,sufficiency,0.5,direct,ablation,tie\n"
    )
    assert default.curve_cell(run, "direct", "sufficiency", "key_mask") == "1/2 (< ablation)"


def test_eviction_geometry_table_is_what_its_results_give():
    names = ("smollm2", "gemma3-270m")
    results = [RESULTS / f"kv-eviction-geometry-{n}-fineweb-edu-512.json" for n in names]
    table = load_benchmark("kv_eviction_geometry").markdown(
        [json.loads(p.read_text()) for p in results]
    )
    assert (RESULTS / "kv-eviction-geometry.md").read_text() == table
    assert "| h2o − window_attention | −0.258 [" in table  # signs as the page prints them


def test_kv_sinks_table_is_what_its_results_give():
    names = ("smollm2", "gemma3-270m")
    results = [RESULTS / f"kv-sinks-{n}-fineweb-edu-512-n32.json" for n in names]
    table = load_benchmark("kv_sinks").markdown([json.loads(p.read_text()) for p in results])
    assert (RESULTS / "kv-sinks-fineweb-edu-512-n32.md").read_text() == table
    # the digits and signs the page prints: SmolLM2's eviction cost, Gemma 3's tie
    assert "| +0.922 [+0.824, +1.023] |" in table
    assert "| −0.015 [−0.030, +0.000] |" in table
    assert "| 4e-12 | 0.061 |" in table


def test_bench_kv_capture_table_is_what_its_result_gives():
    result = json.loads((RESULTS / "bench-kv-smollm2-capture.json").read_text())
    table = load_benchmark("bench_kv").markdown(result)
    assert (RESULTS / "bench-kv-smollm2-capture.md").read_text() == table
    assert table.startswith("Machine: x86_64, torch threads: 1,")
    # the ratios docs/kv-cache.md ("## Cost") prints: C = 512, then C = 2,048
    assert "| capture, no observer | 1.7032 | 1.05 | 7.4617 | 1.03 |" in table
    assert "window-only methods' statistics | 1.9549 | 1.20 | 8.2196 | 1.14 |" in table
    assert "every method's statistics | 2.0953 | 1.29 | 12.6668 | 1.75 |" in table


def test_faithfulness_benchmark_table_is_what_its_results_give():
    results = RESULTS / "bench-faithfulness" / "results.json"
    table = load_benchmark("bench_faithfulness").markdown(json.loads(results.read_text()))
    assert results.with_suffix(".md").read_text() == table
    assert "| 512 | 49 (7) |" in table  # rows per sequence, and per forward


def test_report_benchmark_tables_are_what_their_results_give():
    results = RESULTS / "bench-report" / "results.json"
    tables = load_benchmark("bench_report").markdown(json.loads(results.read_text()))
    assert results.with_suffix(".md").read_text() == tables
    assert "| file, `uint8` (default), 100 MiB limit |" in tables
    assert "| | 2,048 tokens | 8,192 tokens |" in tables  # the long view's lengths, as columns


def test_report_benchmark_says_where_no_browser_measured_the_page():
    result = json.loads((RESULTS / "bench-report" / "results.json").read_text())
    for row in result["long"]:
        del row["page"]
    del result["full"]["page"]
    tables = load_benchmark("bench_report").markdown(result)
    assert "| page open until interactive | not measured (no browser) |" in tables
    assert "switch layer / measure / head" not in tables


def test_attribution_sign_tables_are_what_its_result_gives():
    result = RESULTS / "attribution-sign" / "attribution-sign.json"
    tables = load_benchmark("attribution_sign").markdown(json.loads(result.read_text()))
    assert result.with_suffix(".md").read_text() == tables
    assert "| key_mask | sufficiency | flow - \\|flow\\| | **+0.54 ± 0.19** |" in tables
