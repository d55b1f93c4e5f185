"""The fresh-generator spread table is what its runs give (benchmarks/attribution_spread.py)."""

from __future__ import annotations

from pathlib import Path

from benchmark_scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[1] / "docs" / "results" / "attribution-fresh"


def test_committed_spread_is_what_the_runs_give():
    spread = load_benchmark("attribution_spread")
    assert (ROOT / "spread.md").read_text() == spread.spread_table(ROOT)


def test_every_setting_is_a_fresh_run_of_its_seed():
    import json

    spread = load_benchmark("attribution_spread")
    for model in spread.MODELS:
        for task in spread.TASKS:
            for seed in spread.SEEDS:
                config = json.loads((ROOT / f"{model}-{task}-s{seed}" / "config.json").read_text())
                options = config.get("options", config)
                assert options["generator"] == "fresh" and options["seed"] == seed
                assert options["task"] == task
