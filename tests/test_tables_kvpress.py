"""The kvpress cross-checks' tables are what their committed reports give (no kvpress)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmark_scripts import BENCHMARKS, load_benchmark

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
CROSSCHECK = RESULTS / "kvpress-crosscheck-smollm2-fineweb-edu-512"
PRESSES = RESULTS / "kvpress-presses-smollm2-fineweb-edu-512"


def test_kvpress_crosscheck_table_is_what_its_report_gives():
    report = json.loads(CROSSCHECK.with_suffix(".json").read_text())
    table = load_benchmark("kvpress_crosscheck").markdown(report)
    assert CROSSCHECK.with_suffix(".md").read_text() == table
    # the digits the page prints: the uncompressed runs' gap, AdaKV at 90%, CriticalKV's
    assert "| none (uncompressed) |  |  |  |  |  |  | 9e-06 |" in table
    assert "| `adakv_snapkv` | `AdaKVPress(SnapKVPress)` | 0.9 | 0 / 4 | 81.8% |" in table
    assert (
        "| `criticalkv` | `CriticalKVPress(SnapKVPress)` | 0.75 | 0 / 4 | 99.4% |  |  | 0.004 |"
        in table
    )
    assert "| 0.9 | 0 / 4 | 99.2% |  |  | 0.45 |" in table


def test_kvpress_presses_table_is_what_its_report_gives():
    report = json.loads(PRESSES.with_suffix(".json").read_text())
    table = load_benchmark("kvpress_presses").markdown(report)
    assert PRESSES.with_suffix(".md").read_text() == table
    methods = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(methods) == len(report["methods"]) == 22
    assert all("| 16 / 16 | 100.0% | 0 |" in line for line in methods)


# runs a script as ``python SCRIPT ARGS`` would (its folder importable), then checks what it
# imported
PROBE = """
import runpy, sys
script, sys.argv = sys.argv[1], sys.argv[1:]
sys.path.insert(0, script.rsplit("/", 1)[0])
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as e:
    assert not e.code, e.code
assert "kvpress" not in sys.modules and "torch" not in sys.modules, "imported"
"""


def test_kvpress_tables_need_neither_kvpress_nor_torch(tmp_path):
    """``--table`` runs in the project's environment, before anything heavy is imported."""
    for name, result in (("kvpress_crosscheck", CROSSCHECK), ("kvpress_presses", PRESSES)):
        out = tmp_path / f"{name}.md"
        script = str(BENCHMARKS / f"{name}.py")
        args = [script, "--table", str(out), str(result.with_suffix(".json"))]
        subprocess.run([sys.executable, "-c", PROBE, *args], check=True, capture_output=True)
        assert out.read_text() == result.with_suffix(".md").read_text()
