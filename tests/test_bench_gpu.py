"""benchmarks/bench_gpu.py runs on a CPU with a tiny model of the 8B's family."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmark_scripts import load_benchmark

import contribution_weights as cw

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gpu.py"


def test_bench_gpu_runs_tiny_on_cpu(tmp_path):
    bench = load_benchmark("bench_gpu")
    assert bench.LLAMA_8B["num_hidden_layers"] == 32 and bench.LLAMA_8B["vocab_size"] == 128_256
    code = bench.main(
        [
            "--tiny",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--lengths",
            "48",
            "--methods",
            # no-maps-compiled: in tests/test_kernels.py
            "sdpa,no-maps,no-maps-triton,stream,attribute-direct,attribute-attnlrp",
            "--out",
            str(tmp_path),
            "--profile",
        ]
    )
    assert code == 0
    results = json.loads((tmp_path / "bench_gpu.json").read_text())["results"]
    assert [r["method"] for r in results] == [
        "sdpa", "no-maps", "no-maps-triton", "stream", "attribute-direct", "attribute-attnlrp"
    ]  # fmt: skip
    profile = (tmp_path / "profile-no-maps-48.txt").read_text()
    assert profile.startswith("profiled run:") and "aten::" in profile
    stream = results[3]
    assert stream["disk_mb"] > 0 and all(r["seconds"] > 0 for r in results)
    assert "| 48 | no-maps |" in (tmp_path / "bench_gpu.md").read_text()


def test_bench_kv_runs_a_random_shape_on_cpu(tmp_path):
    """benchmarks/bench_kv.py --shape: the random model of bench_gpu.py, some of its layers,
    every variant and method timed, and the run's settings recorded."""
    script = BENCH.parent / "bench_kv.py"
    out = tmp_path / "kv.json"
    args = ["--shape", "tiny", "--layers", "1", "--device", "cpu", "--dtype", "float32"]
    run = subprocess.run(
        [
            sys.executable,
            str(script),
            *args,
            "--contexts",
            "80",
            "--repeats",
            "1",
            "--triton",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert (
        result["layers"] == 1 and result["repeats"] == 1 and "1 of its 2 layers" in result["model"]
    )
    (row,) = result["rows"]
    assert row["context"] == 80 and row["prefill_s"] > 0
    assert row["scored_triton_s"] > 0 and row["scored_triton_over_prefill"] > 0
    assert set(row["method_s"]) == set(cw.kv.method_names())
    assert "peak_mb" not in row  # CUDA only
    bad = subprocess.run(
        [sys.executable, str(script), "--layers", "2"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "go with --shape" in bad.stderr


def test_gpu_summary_tables_every_case_against_its_baseline_and_target(tmp_path):
    """benchmarks/gpu_summary.py on the committed H200 run: each case's ratio is its wall
    time over the baseline of the same file, the target is judged, a missing step is named."""
    summary = load_benchmark("gpu_summary")
    run = Path(__file__).resolve().parents[1] / "docs" / "results" / "gpu-h200-2026-12-04"
    missing = tmp_path / "whole" / "bench_gpu.json"
    code = summary.main(
        [
            "--kv",
            str(run / "run2-bench_kv.json"),
            "--trace",
            str(run / "run4-bench_gpu.json"),
            "--trace",
            str(missing),
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    result = json.loads((tmp_path / "summary.json").read_text())
    assert result["missing"] == [str(missing)]
    rows = {(r["case"], r["tokens"]): r for r in result["rows"]}
    kv = json.loads((run / "run2-bench_kv.json").read_text())["rows"][1]
    capture = rows[("capture, no observer", 32768)]
    assert capture["layers"] == 2 and capture["target"] == 1.1 and capture["meets"] is False
    assert capture["ratio"] == round(kv["capture_s"] / kv["prefill_s"], 2)
    traced = json.loads((run / "run4-bench_gpu.json").read_text())["results"]
    sdpa = next(r["seconds"] for r in traced if r["method"] == "sdpa")
    triton = next(r["seconds"] for r in traced if r["method"] == "no-maps-triton")
    assert rows[("trace no-maps-triton", 8192)]["ratio"] == round(triton / sdpa, 2)
    assert ("trace sdpa", 8192) not in rows
    text = (tmp_path / "summary.md").read_text()
    assert "| capture, no observer | 32768 | 2 |" in text and str(missing) in text


def test_bench_faithfulness_times_the_sweep_of_a_random_shape_and_the_summary_rows_it(tmp_path):
    """bench_faithfulness.py --shape: one text's sweep (the default 80 configurations and
    the clean row) against plain eager and sdpa forwards of the same batches, no data; the
    summary judges it against sdpa."""
    script = BENCH.parent / "bench_faithfulness.py"
    out = tmp_path / "faithfulness"
    args = ["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--tokens", "40"]
    run = subprocess.run(
        [sys.executable, str(script), *args, "--repeats", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=BENCH.parent,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    (row,) = json.loads((out / "results.json").read_text())["rows"]
    assert row["tokens"] == 40 and row["rows_per_sequence"] == 81
    assert row["sweep_seconds"] > 0 and row["sdpa_forward_seconds"] > 0
    summary = load_benchmark("gpu_summary")
    assert summary.main(["--faithfulness", str(out / "results.json"), "--out", str(tmp_path)]) == 0
    (case,) = json.loads((tmp_path / "summary.json").read_text())["rows"]
    assert case["case"] == "faithfulness sweep, one text (80 configurations)"
    assert case["target"] == 2.0 and case["layers"] == 2
    assert case["ratio"] == round(row["sweep_seconds"] / row["sdpa_forward_seconds"], 2)
