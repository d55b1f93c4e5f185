"""A measure defined outside the package, in one place, is seen everywhere: the API, the
storage planner, the reductions, faithfulness's token scores, the CLI, the report and the
figures. Nothing in the package names it."""

from __future__ import annotations

import pytest
import torch
from tiny_models import save_tiny, tiny_model

import contribution_weights as cw
from contribution_weights.cli import main
from contribution_weights.measures import layer
from contribution_weights.measures.registry import (
    MEASURES,
    Recipe,
    RowScaled,
    Style,
    stored_measures,
)
from contribution_weights.presentation.figures import measure_style

TEXT = "The quick brown fox jumps over the lazy dog again."
NAME = "attention_on"  # α_ij / ‖o_i‖: attention scaled per query by the output's norm


def _compute(lt: layer.LayerTensors) -> torch.Tensor:
    return lt.masked_(lt.probs * lt.inv_output_norm[:, None, :, None])


def _column_sums(lt: layer.LayerTensors) -> torch.Tensor:
    return torch.einsum("bi,bhit->bht", lt.inv_output_norm, lt.probs)


def _from_attention(f: layer.Factors) -> torch.Tensor:
    return f.maps["attention"] * f.inv_output_norm


@pytest.fixture
def attention_on():
    measure = cw.register_measure(
        cw.Measure(
            NAME,
            _compute,
            "α / ‖o_i‖ (a test measure)",
            normalise=lambda w: w / w.sum(dim=(-3, -1), keepdim=True).clamp_min(1e-30),
            recipes=(Recipe(("attention",), _from_attention),),
            derived_only=True,
            algebra=RowScaled("attention", lambda lt: lt.inv_output_norm),
            column_sums=_column_sums,
            style=Style("black", "*"),
        )
    )
    yield measure
    MEASURES.unregister(NAME)
    assert NAME not in cw.measure_names()


def test_api_storage_and_reductions(attention_on):
    lm = tiny_model("llama")
    assert stored_measures([NAME, "attention"]) == ["attention"]  # read from α, not stored
    full = cw.trace(lm, TEXT, measures=["attention", NAME])
    reduced = cw.trace(lm, TEXT, measures=["attention", NAME], maps=False)
    alpha = full["attention"].tensor()
    lt_norm = full[NAME].tensor()
    # the derived map is α scaled per query, so where α > 0 the ratio is constant per query
    ratio = torch.where(alpha > 0, lt_norm / alpha, torch.nan)
    spread = ratio.nan_to_num(0).amax(-1) - ratio.nan_to_num(1e30).amin(-1)
    assert float(spread[alpha.sum(-1) > 0].abs().max()) < 1e-4
    # reductions folded block by block through the algebra equal those of the map
    torch.testing.assert_close(reduced.token_scores(NAME), full.token_scores(NAME))
    values, keys = reduced.top_k(NAME, 3)
    full_values, full_keys = full.top_k(NAME, 3)
    torch.testing.assert_close(values, full_values)
    assert torch.equal(keys, full_keys)
    assert NAME in reduced.summary().index


def test_faithfulness_ranks_by_its_column_sums(attention_on):
    lm = tiny_model("llama")
    res = cw.faithfulness(lm, [TEXT, TEXT[::-1]], measures=[NAME], rates=[0.5], progress=False)
    rows = res.per_sequence
    assert set(rows.measure) == {NAME} and rows.nll.notna().all()


def test_cli_report_and_figures(attention_on, tmp_path, capsys):
    folder = save_tiny("llama", tmp_path / "model")
    assert main(["measures"]) == 0
    assert NAME in capsys.readouterr().out
    out = tmp_path / "trace"
    args = ["trace", "--text", TEXT, "--model", str(folder), "--measures", f"attention,{NAME}"]
    assert main([*args, "--out", str(out), "--no-figures"]) == 0
    loaded = cw.Trace.load(out)
    assert NAME in loaded.measures
    from contribution_weights.presentation.report import write_report

    report = write_report(loaded, tmp_path / "r.html", measures=[NAME], progress=False)
    assert NAME in report.measures and NAME in (tmp_path / "r.html").read_text()
    assert measure_style(NAME) == ("black", "*")
