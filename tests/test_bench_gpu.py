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
            "sdpa,no-maps,no-maps-triton,stream",  # -compiled: in tests/test_kernels.py
            "--out",
            str(tmp_path),
            "--profile",
        ]
    )
    assert code == 0
    results = json.loads((tmp_path / "bench_gpu.json").read_text())["results"]
    assert [r["method"] for r in results] == ["sdpa", "no-maps", "no-maps-triton", "stream"]
    profile = (tmp_path / "profile-no-maps-48.txt").read_text()
    assert profile.startswith("profiled run:") and "aten::" in profile
    stream = results[-1]
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
    assert set(row["method_s"]) == set(cw.kv.method_names())
    assert "peak_mb" not in row  # CUDA only
    bad = subprocess.run(
        [sys.executable, str(script), "--layers", "2"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "go with --shape" in bad.stderr
