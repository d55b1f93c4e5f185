"""benchmarks/attribution_routes.py: the prefix-matching score, the route scores and the
committed tables, which are what their JSON gives."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from benchmark_scripts import load_benchmark
from tiny_models import tiny_model

from contribution_weights.attribution.result import Edge, Routes

routes_script = load_benchmark("attribution_routes")
RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results" / "attribution-routes"


def test_route_scores_read_the_copy_edge_and_its_head():
    edges = [
        Edge(3, 5, 9, 1, 0.4),  # the source straight into the target through head (3, 1)
        Edge(2, 7, 5, 0, 0.2),  # into the source from below
        Edge(1, 4, 4, -1, 0.1),  # a residual edge of position 4
    ]
    routes = Routes(0, 9, 0.02, edges, 4)
    hits = routes_script.route_hits(routes, 9, 5, {(3, 1)})
    assert hits["on_route"] and hits["copy_edge"] and hits["copy_by_induction_head"]
    assert hits["copy_heads"] == [[3, 1, 0.4]]
    other_head = routes_script.route_hits(routes, 9, 5, {(3, 0)})
    assert other_head["copy_edge"] and not other_head["copy_by_induction_head"]
    below = routes_script.route_hits(routes, 9, 7, {(2, 0)})  # on the route, not into 9
    assert below["on_route"] and not below["copy_edge"] and not below["copy_by_induction_head"]
    residual = routes_script.route_hits(routes, 9, 4, set())  # a residual edge is no copy
    assert residual["on_route"] and not residual["copy_edge"]
    absent = routes_script.route_hits(routes, 9, 2, {(3, 1)})
    assert absent == {"copy_heads": [], "on_route": False, "copy_edge": False,
                      "copy_by_induction_head": False}  # fmt: skip


def test_prefix_matching_is_a_mean_attention_per_head():
    model = tiny_model("llama")
    score = routes_script.prefix_matching(model, n=2, length=6, seed=0, words=list(range(3, 40)))
    config = model.model.config
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    assert score.shape == (layers, heads)
    assert np.all((score >= 0) & (score <= 1))
    assert routes_script._ranked(score)[0] == np.unravel_index(np.argmax(score), score.shape)


def test_summary_pairs_source_and_control_over_items():
    def row(source: bool, control: bool) -> dict:
        return {"at_source": dict.fromkeys(routes_script.KEYS, source),
                "at_control": dict.fromkeys(routes_script.KEYS, control)}  # fmt: skip

    rows = [row(True, False)] * 6 + [row(True, True)] * 2 + [row(False, True)] + [row(False, False)]
    s = routes_script.summary_of(rows)["copy_edge"]
    assert s["source_rate"] == 0.8 and s["control_rate"] == 0.3
    assert (s["source_only"], s["control_only"]) == (6, 1)
    assert s["mcnemar_p"] == pytest.approx(16 / 128)  # two-sided exact: 2 * P(X <= 1), n = 7
    lo, hi = s["source_wilson95"]
    assert 0.44 < lo < 0.8 < hi < 0.97


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.stem)
def test_committed_tables_are_what_their_rows_give(path):
    out = json.loads(path.read_text())
    score = np.array(out["prefix_matching"])
    for t in out["tasks"].values():
        assert json.loads(json.dumps(routes_script.summary_of(t["rows"]))) == t["summary"]
        assert routes_script.copy_heads_of(t["rows"], score) == t["copy_heads"]
    assert path.with_suffix(".md").read_text() == routes_script.markdown(out)
