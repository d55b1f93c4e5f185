"""attribution_layers.py's and attribution_first_token.py's committed Markdown tables are what
their committed results give."""

from __future__ import annotations

import json
from pathlib import Path

from benchmark_scripts import load_benchmark

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
MODELS = ("smollm2", "gemma3-270m")
TASKS = ("induction", "lookup", "passkey")


def _load(paths: list[Path]) -> list[dict]:
    return [json.loads(p.read_text()) for p in paths]


def test_attribution_layers_tables_are_what_their_results_give():
    paths = [RESULTS / f"attribution-layers-{m}-{t}.json" for m in MODELS for t in TASKS]
    table = load_benchmark("attribution_layers").markdown(_load(paths))
    assert (RESULTS / "attribution-layers.md").read_text() == table
    # the numbers the page quoted: SmolLM2 induction's token 0 and source, split by block
    assert "| token 0's flow score (mean ± s.e.) | +0.425 ± 0.105 | +0.064 ± 0.070 |" in table
    assert "| source's parts: attention, feed-forward, embedding | +0.197, +0.288, 0.000 |" in table
    assert "| 24 | +0.183 ± 0.039 |" in table and "| 23 (copying) | −0.169 ± 0.021 |" in table
    # Gemma 3 induction: layers 0, 1 and 5 at the source, and the source's own share
    assert (
        "| 0 | +0.001 ± 0.000 | −0.001 ± 0.000 | 0.000 ± 0.000 | 0.000 ± 0.000 | 0.04 | 4.76 |"
        in table
    )
    assert "| 0.26 | 1.71 | 0.68 | 0.47 | 0.416 → 0.120 |" in table
    assert "| copying layer (items) | 23 (57), 24 (5), 26 (2) |" in table
    assert "| token 0's score above the source's (items) | 27 of 64 | 14 of 64 |" in table


def test_attribution_layers_lists_the_largest_parts_and_the_smallest_rho():
    result = json.loads((RESULTS / "attribution-layers-gemma3-270m-induction.json").read_text())
    layers = load_benchmark("attribution_layers").listed_layers(result)
    assert {0, 1, 5, 11, 13, 15, 16} <= set(layers)  # small ρ, the copying layer, big parts
    assert layers == sorted(layers)


def test_attribution_first_token_tables_are_what_their_results_give():
    paths = [RESULTS / f"attribution-first-token-{m}.json" for m in MODELS]
    table = load_benchmark("attribution_first_token").markdown(_load(paths))
    assert (RESULTS / "attribution-first-token.md").read_text() == table
    assert "| pure flow (the final state) | +0.913 | 0.913 |" in table  # Gemma 3's <bos>
    assert '| input × gradient of log P(`" Berlin"`) | +0.017 | 0.028 |' in table
    assert "| 1 | 0.42 | 0.14 |" in table  # token 0's share of the last position's y
