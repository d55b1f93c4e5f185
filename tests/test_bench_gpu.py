"""benchmarks/bench_gpu.py runs on a CPU with a tiny model of the 8B's family."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gpu.py"


def test_bench_gpu_runs_tiny_on_cpu(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
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
        ]
    )
    assert code == 0
    results = json.loads((tmp_path / "bench_gpu.json").read_text())["results"]
    assert [r["method"] for r in results] == ["sdpa", "no-maps", "no-maps-triton", "stream"]
    stream = results[-1]
    assert stream["disk_mb"] > 0 and all(r["seconds"] > 0 for r in results)
    assert "| 48 | no-maps |" in (tmp_path / "bench_gpu.md").read_text()
