"""benchmarks/kv_needles.py's committed Markdown tables are what its committed results give."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmark_scripts import BENCHMARKS, load_benchmark

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
FOLDERS = [RESULTS / f"kv-needles-{name}-4096" for name in ("smollm2", "gemma3-270m")]
TABLE = RESULTS / "kv-needles-4096.md"


def test_kv_needles_table_is_what_its_results_give():
    table = load_benchmark("kv_needles").markdown(FOLDERS)
    assert TABLE.read_text() == table
    # what the page's "Where the needles sit" rests on, with the digits the page printed
    for row in (
        "| `niah_multivalue` | query-agnostic, 0.5 | 45 | 0.67 | 0.65 | 0.21 | 0.46 (`h2o_recent`) "
        "| 11 / 0 |",
        "| `niah_multivalue` | query-aware, 0.5 | 45 | 0.67 | 0.68 | 0.24 | 0.64 (`tova`) "
        "| 10 / 0 |",
        "| `niah_multivalue` | query-agnostic, 0.1 | 50 | 0.48 |",  # 0.475, its half rounded up
        "| `niah_multiquery` | query-agnostic, 0.5 | 48 | 0.49 | 0.42 | 0.09 | 0.28 (`tova`) "
        "| 11 / 0 |",
        "| `niah_multivalue` | query-agnostic and query-aware | 0.14 | 0.41 | 0.50 | 0.76 |",
        "| query-agnostic | `contribution` | 0.91 / 0.92 / 0.60 | 0.84 / 0.86 / 0.50 |",
    ):
        assert row in table


def test_kv_needles_table_option_writes_it_before_any_model_or_data_loads(tmp_path):
    out = tmp_path / "needles.md"
    script = BENCHMARKS / "kv_needles.py"
    done = subprocess.run(
        [sys.executable, str(script), "--table", str(out), *map(str, FOLDERS)],
        capture_output=True, text=True, check=True, env={"HOME": str(tmp_path)},
    )  # fmt: skip
    assert out.read_text() == TABLE.read_text()
    assert f"wrote {out}" in done.stdout
