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
    AbsoluteOf,
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
    assert set(rows.measure) == {NAME, "random:0", "random:1", "random:2", "recency"}
    assert rows.nll.notna().all()


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


# ---- an experiment: one module (options, experiment, result, entry point, spec) + figure -----
def _lengths_experiment():
    from collections.abc import Iterator
    from dataclasses import dataclass

    import pandas as pd

    from contribution_weights.experiments.options import Options, option
    from contribution_weights.experiments.result import ExperimentResult, read_csv, write_csv
    from contribution_weights.experiments.runner import Experiment, Phase, run_experiment
    from contribution_weights.runs import fingerprint

    @dataclass
    class LengthOptions(Options):
        max_tokens: int = option(512, "cut texts to N tokens", flag="--max-tokens", parse="int")

        def validate(self) -> None:
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")

    class LengthResult(ExperimentResult):
        def __init__(self, rows, config, run_info=None):
            super().__init__(config, run_info)
            self.rows = rows
            self.summary = pd.DataFrame({"texts": [len(rows)], "tokens": [rows.tokens.sum()]})

        def write_files(self, folder):
            write_csv(folder / "lengths.csv", self.rows)

        @classmethod
        def from_files(cls, folder, config, run_info):
            rows = pd.DataFrame(read_csv(folder / "lengths.csv")).astype({"tokens": int})
            return cls(rows, config, run_info)

    class Lengths(Experiment[LengthResult]):
        name = "lengths"

        def __init__(self, model, texts, options):
            self.model, self.texts, self.options = model, list(texts), options

        def config(self):
            return {"experiment": self.name, "model": self.model.name,
                    **self.options.to_dict(), "texts_sha256": fingerprint(self.texts)}  # fmt: skip

        def run(self, i):
            ids = self.model.tokenizer(self.texts[i])["input_ids"][: self.options.max_tokens]
            return [{"text": i, "tokens": len(ids)}]

        def phases(self) -> Iterator[Phase]:
            yield Phase("lengths", range(len(self.texts)), self.run,
                        rows_file="lengths.csv", key="text", rows_per_unit=1)  # fmt: skip

        def result(self, rows, run_info):
            frame = pd.DataFrame(rows["lengths.csv"]).astype({"tokens": int})
            return LengthResult(frame, self.config(), run_info)

    def lengths(model, texts, *, options=None, out=None, resume=False, source=""):
        return run_experiment(Lengths(model, texts, options or LengthOptions()), out,
                              resume=resume, progress=False)  # fmt: skip

    def figure(result, path=None):
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots()
        ax.bar(result.rows.text, result.rows.tokens)
        if path is not None:
            fig.savefig(path)
        return fig

    return LengthOptions, LengthResult, lengths, figure


def test_an_experiment_registered_from_outside_gets_its_command(tmp_path, capsys):
    from contribution_weights.experiments.spec import EXPERIMENTS, ExperimentSpec
    from contribution_weights.presentation import figures

    options, result_type, run, figure = _lengths_experiment()
    spec = ExperimentSpec("lengths", "tokens per text (a test)", options, run,
                          figure="lengths.png")  # fmt: skip
    try:
        from contribution_weights.experiments.spec import register_experiment

        register_experiment(spec)
        figures.register_figure(result_type, figure)
        folder = save_tiny("llama", tmp_path / "model")
        texts = tmp_path / "texts.txt"
        texts.write_text("one two three\n\nfour five\n\nsix")
        out = tmp_path / "run"
        argv = ["lengths", "--file", str(texts), "--model", str(folder), "--out", str(out)]
        assert main([*argv, "--max-tokens", "0"]) == 2  # the options validate themselves
        assert "--max-tokens must be at least 1" in capsys.readouterr().err
        assert main([*argv, "--max-tokens", "4"]) == 0
        printed = capsys.readouterr().out
        assert "lengths.csv" in printed and "lengths.png" in printed
        assert (out / "lengths.png").stat().st_size > 0
        loaded = result_type.load(out)
        assert len(loaded.rows) == 3 and loaded.rows.tokens.max() <= 4
        assert main([*argv, "--max-tokens", "4", "--resume"]) == 0  # resumes: nothing to redo
        assert cw.plot(loaded) is not None  # the API draws the same registered figure
    finally:
        EXPERIMENTS.unregister("lengths")
        figures._FIGURES.pop(result_type, None)


def test_loading_a_trace_of_an_unregistered_measure_says_to_register_it(tmp_path):
    """A trace of a measure registered in another process: loading it names the measure
    and the fix, instead of failing later on "unknown measure" in summary() or a report."""
    from contribution_weights.tracing.storage import TraceFileError

    measure = cw.register_measure(
        cw.Measure(
            "vw2",
            lambda lt: lt.masked_(lt.probs * 2.0),
            "2α (a test measure)",
            normalise=lambda w: w / w.sum(dim=(-3, -1), keepdim=True).clamp_min(1e-30),
        )
    )
    try:
        folder = tmp_path / "trace"
        cw.trace(tiny_model("llama"), TEXT, measures=["attention", "vw2"], out=folder)
        assert "vw2" in cw.Trace.load(folder).summary().index  # registered: loads
    finally:
        MEASURES.unregister("vw2")
    with pytest.raises(TraceFileError) as err:
        cw.Trace.load(folder)
    message = str(err.value)
    assert "holds the measure 'vw2', which is not registered in this process" in message
    assert "cw.register_measure" in message and "before loading" in message
    assert "'attention'" not in message  # only the missing ones are named
    cw.register_measure(measure)  # registered again (as the tracing process did): it loads
    try:
        assert "vw2" in cw.Trace.load(folder).summary().index
    finally:
        MEASURES.unregister("vw2")


@pytest.mark.parametrize("name", ["recency", "random", "random:3", "Flow", "rollout", "alti"])
def test_a_measure_cannot_take_a_baseline_rankings_name(name):
    """Removal experiments name their baselines beside the measures; a measure called
    ``flow`` would be silently replaced by the flow baseline there, so it is refused."""
    before = cw.measure_names()
    with pytest.raises(ValueError, match=f"cannot be named '{name}'.*baseline ranking"):
        cw.register_measure(cw.Measure(name, lambda lt: lt.probs, "a test measure"))
    assert cw.measure_names() == before


def test_the_pieces_of_a_measure_are_exported_with_it():
    """``cw.measures.RowScaled`` and the rest, beside ``cw.Measure``, for a new measure."""
    from contribution_weights.measures import registry

    for name in ("Recipe", "RowScaled", "AbsoluteOf", "RankOne", "Style", "MEASURES"):
        assert getattr(cw.measures, name) is getattr(registry, name), name
        assert name in cw.measures.__all__


def test_reductions_share_only_between_weights():
    """A derived measure reuses its base's entropies and top keys only when both are
    weights; otherwise it is reduced from its own block (no crash, the same numbers as
    traced alone)."""
    lm = tiny_model("llama")
    scaled_alpha = cw.Measure(
        "alpha_over_o", _compute, "α/‖o‖, not a weight",
        algebra=RowScaled("attention", lambda lt: lt.inv_output_norm),
    )  # fmt: skip
    abs_cosine = cw.Measure(
        "abs_cosine", lambda lt: layer.cosine(lt).abs(), "|κ| as a weight",
        normalise=lambda w: w / w.sum(dim=(-3, -1), keepdim=True).clamp_min(1e-30),
        algebra=AbsoluteOf("cosine"),
    )  # fmt: skip
    try:
        for m in (scaled_alpha, abs_cosine):
            cw.register_measure(m)
        with_base = cw.trace(lm, TEXT, measures=["attention", "cosine", *MEASURE_PAIR], maps=False)
        for name in MEASURE_PAIR:
            alone = cw.trace(lm, TEXT, measures=[name], maps=False)
            torch.testing.assert_close(with_base.token_scores(name), alone.token_scores(name))
        ent = with_base.reduced("abs_cosine").mean_entropy()
        alone = cw.trace(lm, TEXT, measures=["abs_cosine"], maps=False)
        assert ent == pytest.approx(alone.reduced("abs_cosine").mean_entropy()) and ent > 0
    finally:
        for name in MEASURE_PAIR:
            MEASURES.unregister(name)


MEASURE_PAIR = ("alpha_over_o", "abs_cosine")


PLUGIN = """
import contribution_weights as cw

cw.register_measure(cw.Measure("plugin_double", lambda lt: lt.probs * 2, "twice α (a plugin)"))
"""


def test_a_plugin_module_reaches_the_shell_command(tmp_path, monkeypatch, capsys):
    """``CW_PLUGINS`` names modules ``cw`` imports before building its parser, so what they
    register is a choice of every command (the shell's ``cw`` imports no user code else)."""
    (tmp_path / "cw_test_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("CW_PLUGINS", " cw_test_plugin, ")
    try:
        assert main(["measures"]) == 0
        assert "plugin_double" in capsys.readouterr().out
    finally:
        MEASURES.unregister("plugin_double")
        import sys

        sys.modules.pop("cw_test_plugin", None)
    assert "plugin_double" not in cw.measure_names()


def test_a_missing_plugin_is_a_clear_error(tmp_path, monkeypatch, capsys):
    (tmp_path / "cw_broken_plugin.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("CW_PLUGINS", "no_such_plugin_xyz")
    assert main(["measures"]) == 2
    err = capsys.readouterr().err
    assert "CW_PLUGINS" in err and "'no_such_plugin_xyz'" in err and "PYTHONPATH" in err
    # a plugin that is found but fails on its own import shows that error, not ours
    monkeypatch.setenv("CW_PLUGINS", "cw_broken_plugin")
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_xyz"):
        main(["measures"])


def test_a_plugin_given_as_a_file_and_errors_inside_a_plugin(tmp_path, monkeypatch, capsys):
    """A path or ``.py`` name is answered with the fix; a ValueError raised by the plugin's
    own code keeps its traceback (it is not taken for a missing module)."""
    monkeypatch.setenv("CW_PLUGINS", "./mymethods.py")
    assert main(["measures"]) == 2
    err = capsys.readouterr().err
    assert "not a module name" in err and "CW_PLUGINS=mymethods" in err
    (tmp_path / "cw_raising_plugin.py").write_text("raise ValueError('bad plugin setting')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("CW_PLUGINS", "cw_raising_plugin")
    try:
        with pytest.raises(ValueError, match="bad plugin setting"):
            main(["measures"])
    finally:
        import sys

        sys.modules.pop("cw_raising_plugin", None)


def test_the_resume_hint_keeps_the_plugins(monkeypatch):
    from contribution_weights.experiments.runner import resume_hint

    monkeypatch.setenv("CW_PLUGINS", "lengths")
    assert resume_hint(["lengths", "--out", "runs/l"]) == (
        "CW_PLUGINS=lengths cw lengths --out runs/l --resume"
    )
    monkeypatch.delenv("CW_PLUGINS")
    assert resume_hint(["lengths", "--out", "runs/l"]) == "cw lengths --out runs/l --resume"
