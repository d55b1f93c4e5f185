"""``cw geometry`` runs: resumable run folders, the output files, and SmolLM2 end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from tiny_models import tiny_model

from contribution_weights.cli import main
from contribution_weights.experiments import geometry as geometry_run
from contribution_weights.experiments.geometry import JSON_KEYS, GeometryOptions
from contribution_weights.presentation.geometry_plots import FIGURES, write_figures, write_markdown
from contribution_weights.runs import RunFolderError

#: the published run folders (docs/results): tables, no state (state.pt is not published)
PUBLISHED = sorted((Path(__file__).parents[1] / "docs" / "results").glob("geometry-*"))
TEXTS = ["The cat sat on the mat.", "Water boils at 100 degrees.", "One, two, three, four."]
OPTS = GeometryOptions(max_tokens=None, cap=500, gammas=(1.0, 0.0), sink_layers=[1])


def test_interrupted_run_resumes_to_the_same_tables(tmp_path, monkeypatch):
    lm = tiny_model("llama")
    full = geometry_run.run_geometry(lm, TEXTS, tmp_path / "full", options=OPTS, progress=False)
    calls = {"n": 0}
    real_observe = geometry_run.Geometry.observe

    def crash_on_the_third(self, i):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        real_observe(self, i)

    monkeypatch.setattr(geometry_run.Geometry, "observe", crash_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        geometry_run.run_geometry(lm, TEXTS, tmp_path / "cut", options=OPTS, progress=False)
    monkeypatch.setattr(geometry_run.Geometry, "observe", real_observe)
    with pytest.raises(RunFolderError, match="--resume"):
        geometry_run.run_geometry(lm, TEXTS, tmp_path / "cut", options=OPTS, progress=False)
    other = GeometryOptions(max_tokens=None, cap=501, gammas=(1.0, 0.0), sink_layers=[1])
    with pytest.raises(RunFolderError, match="cap"):
        geometry_run.run_geometry(
            lm, TEXTS, tmp_path / "cut", options=other, resume=True, progress=False
        )
    resumed = geometry_run.run_geometry(
        lm, TEXTS, tmp_path / "cut", options=OPTS, resume=True, progress=False
    )
    assert resumed.sequences == 3
    assert resumed.to_json() == full.to_json()
    tables = json.loads((tmp_path / "cut" / "tables.json").read_text())
    assert tuple(tables) == JSON_KEYS
    assert set(tables["first_token_weight"]) == {"attention", "vw", "contribution"}
    assert set(tables["entropy"]) == {"all", "excluding_first"}


def test_config_fingerprint_is_the_digest_older_run_folders_stored(tmp_path):
    """Run folders written before ``runs.fingerprint`` stored the first 16 hex digits of
    sha256 over each text plus a NUL byte; the same digest keeps them resumable."""
    texts = ["The cat sat.", "naïve — ünïcode\n", "x"]
    geometry_run.run_geometry(
        tiny_model("llama"), texts, tmp_path / "run", options=OPTS, progress=False
    )
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["texts_sha256"] == "1e019e889666ad7f"


def test_every_output_file_is_replaced_atomically(tmp_path, monkeypatch):
    from contribution_weights.runs import RunFolder

    written: list[str] = []
    real_write = RunFolder.write_bytes

    def spy(self, name, data):
        written.append(name)
        return real_write(self, name, data)

    monkeypatch.setattr(RunFolder, "write_bytes", spy)
    geometry_run.run_geometry(
        tiny_model("llama"), TEXTS[:1], tmp_path, options=OPTS, progress=False
    )
    outputs = {"state.pt", "tables.json", "per_layer.csv", "norm_fit.csv", "meta.json"}
    assert outputs <= set(written)
    appended = {"sink_scaling.csv"}  # appended row by row (a cut line is dropped on resume)
    assert {p.name for p in tmp_path.iterdir()} == outputs | appended | {
        "config.json",
        "run_info.json",
    }  # no *.tmp left


class _Unsafe:
    """A pickled object: loading state.pt must never run code from the run folder."""


def test_state_loads_with_weights_only_and_refuses_pickled_objects(tmp_path):
    import torch

    lm = tiny_model("llama")
    geometry_run.run_geometry(lm, TEXTS[:2], tmp_path, options=OPTS, progress=False)
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    assert state["sequences"] == 2
    torch.save({"sequences": 2, "payload": _Unsafe()}, tmp_path / "state.pt")
    with pytest.raises(RunFolderError, match=r"delete state\.pt"):
        geometry_run.run_geometry(
            lm, TEXTS[:2], tmp_path, options=OPTS, resume=True, progress=False
        )


def test_no_sink_layer_skips_the_scaling_passes_and_says_so(tmp_path, monkeypatch):
    from contribution_weights.experiments.geometry import NoSinkLayersWarning
    from contribution_weights.experiments.geometry import run as geometry

    def no_pass(*args, **kwargs):
        raise AssertionError("sink-scaling forward passes ran without sink layers")

    monkeypatch.setattr(geometry, "sink_scaling_nll", no_pass)
    lm = tiny_model("llama")
    opts = GeometryOptions(max_tokens=None, cap=500, gammas=(1.0, 0.0), sink_layer_threshold=1.0)
    with pytest.warns(NoSinkLayersWarning, match="--sink-layer-threshold"):
        res = geometry_run.run_geometry(
            lm, TEXTS, tmp_path, ["sink_scaling", "entropy"], opts, progress=False
        )
    scaling = json.loads((tmp_path / "tables.json").read_text())["sink_scaling"]
    assert scaling["layers"] == [] and scaling["by_gamma"] == []
    assert "no layer has mean α_i0 above the sink-layer threshold 1.0" in scaling["skipped"]
    assert "Not run: no layer" in write_markdown(res, tmp_path / "tables.md", "tiny")
    assert "geometry-sink_scaling.png" not in {p.name for p in write_figures(res, tmp_path)}
    with pytest.warns(NoSinkLayersWarning, match="given sink layers are empty"):
        empty = GeometryOptions(max_tokens=None, gammas=(1.0, 0.0), sink_layers=[])
        res = geometry.analyse(lm, TEXTS[:1], ["sink_scaling"], empty)
    assert res.sink_scaling is not None and res.sink_scaling.table.empty


def test_figures_and_markdown(tmp_path):
    lm = tiny_model("qwen2")
    res = geometry_run.run_geometry(lm, TEXTS, tmp_path, options=OPTS, progress=False)
    paths = write_figures(res, tmp_path, title="tiny")
    assert sorted(p.name for p in paths) == sorted(f"geometry-{f}.png" for f in FIGURES)
    assert all(p.stat().st_size > 1000 for p in paths)
    md = write_markdown(res, tmp_path / "tables.md", "tiny")
    for heading in (
        "Table 1",
        "Table 2",
        "Table 3",
        "Table 4",
        "Table 5",
        "Figure 5",
        "Figure 6c",
        "§6.2",
        "Figure 6a/b",
    ):
        assert heading in md
    assert (tmp_path / "per_layer.csv").exists() and (tmp_path / "norm_fit.csv").exists()


def test_cli_rejects_bad_options_before_loading(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("hello")
    assert (
        main(["geometry", "--file", str(text), "--out", str(tmp_path / "o"), "--only", "bogus"])
        == 2
    )
    assert "unknown analysis 'bogus'" in capsys.readouterr().err
    assert (
        main(["geometry", "--file", str(text), "--out", str(tmp_path / "o"), "--gammas", "2"]) == 2
    )
    assert "[0, 1]" in capsys.readouterr().err


@pytest.mark.slow
def test_smollm2_end_to_end(smollm2, tmp_path):
    texts = [
        "The quick brown fox jumps over the lazy dog while the farmer watches.",
        "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
    ]
    opts = GeometryOptions(max_tokens=24, cap=20_000, gammas=(1.0, 0.0))
    res = geometry_run.run_geometry(smollm2, texts, tmp_path, options=opts, progress=False)
    tables = json.loads((tmp_path / "tables.json").read_text())
    assert tuple(tables) == JSON_KEYS and all(tables[k] is not None for k in JSON_KEYS)
    ftw = tables["first_token_weight"]
    assert 0 < ftw["attention"] <= 1 and 0 < ftw["vw"] <= 1
    # SmolLM2 has attention sinks: detected layers, and attention over-weights token 0
    assert tables["sink_scaling"]["layers"], "expected some sink layers"
    assert ftw["attention"] > ftw["contribution"]
    r2 = res.log_regression_r2
    assert r2 is not None
    assert np.isfinite(r2.to_numpy()).all()
    assert len(write_figures(res, tmp_path)) == len(FIGURES)


def _close(a, b, path=""):
    """Nested JSON tables equal, numbers to 1e-9 relative (sums in another order)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-12), path
    else:
        assert a == b, path


def test_accumulators_split_over_sequences_merge_to_the_one_pass_tables():
    """Two accumulators fed alternate sequences, merged, give one accumulator's tables:
    the sampled points exactly, the summed statistics to float rounding."""
    from contribution_weights.experiments.geometry import GeometryAccumulator, encode_texts

    lm = tiny_model("llama")
    texts = [*TEXTS, "A fourth text, a little longer than the others.", "Five."]
    opts = GeometryOptions(max_tokens=None, cap=60, gammas=(1.0, 0.0), sink_layers=[1])
    names = [n for n in geometry_run.ANALYSES if n != "sink_scaling"]
    ids = encode_texts(lm, texts, None)

    def acc():
        return GeometryAccumulator(lm.num_layers, lm.num_heads, names, opts)

    one = acc()
    for i, x in enumerate(ids):
        one.add_sequence(lm, x, unit=i)
    parts = [acc(), acc()]
    for i, x in enumerate(ids):
        parts[i % 2].add_sequence(lm, x, unit=i)
    merged = acc()
    for part in reversed(parts):  # merge order does not matter either
        merged.merge_state(part.state_dict())
    a, b = one.result(), merged.result()
    assert merged.units == list(range(len(texts))) and b.sequences == len(texts)
    _close(b.to_json(), a.to_json())
    assert a.joint is not None and b.joint is not None and len(a.joint) == 60  # cap reached

    pd.testing.assert_frame_equal(b.joint, a.joint)  # the same sample, in the same order
    for key in a.norm_points or {}:
        np.testing.assert_array_equal(b.norm_points[key], a.norm_points[key])
    assert a.cone_snapshot is not None and b.cone_snapshot is not None
    for key, value in a.cone_snapshot.items():
        np.testing.assert_array_equal(b.cone_snapshot[key], value)
    with pytest.raises(ValueError, match="share sequences"):
        merged.merge_state(parts[0].state_dict())


def test_geometry_result_saves_and_loads_back(tmp_path):
    from contribution_weights.experiments.geometry import GeometryResult

    lm = tiny_model("llama")
    res = geometry_run.run_geometry(lm, TEXTS, tmp_path / "run", options=OPTS, progress=False)
    loaded = GeometryResult.load(tmp_path / "run")
    assert loaded.to_json() == res.to_json() and loaded.config == res.config
    again = GeometryResult.load(loaded.save(tmp_path / "copy"))
    assert again.to_json() == res.to_json() and again.run_info == res.run_info
    assert again.tokens == res.tokens


def test_every_published_folder_is_found():
    assert len(PUBLISHED) >= 4 and all(p.is_dir() for p in PUBLISHED)


@pytest.mark.parametrize("folder", PUBLISHED, ids=lambda p: p.name)
def test_published_folders_load_to_their_tables(folder, tmp_path):
    """A published run folder (no state.pt) loads from its tables: to_json() gives its
    tables.json back and the Markdown renders as its tables.md (below the title)."""
    from contribution_weights.experiments.geometry import GeometryResult

    res = GeometryResult.load(folder)
    tables = json.loads((folder / "tables.json").read_text())
    _close(res.to_json(), tables)
    assert tuple(tables) == JSON_KEYS and res.analyses == res.config["analyses"]
    md = write_markdown(res, tmp_path / "tables.md", "title")
    published = (folder / "tables.md").read_text()
    assert md.split("\n", 1)[1] + "\n" == published.split("\n", 1)[1]


def test_joint_distribution_plot_has_a_colourbar_per_panel():
    from contribution_weights.presentation.geometry_plots import plot_joint_distributions

    res = geometry_run.analyse(tiny_model("llama"), TEXTS, ["joint_distributions"], OPTS)
    fig = plot_joint_distributions(res.joint)
    colourbars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert len(colourbars) == 2 and "log scale" in colourbars[0].get_ylabel()


def test_a_new_analysis_is_one_registered_class(tmp_path, monkeypatch):
    """An analysis defined outside the package is one class (statistic, table, JSON,
    per-layer columns, Markdown) plus its figure registered with the presentation layer;
    the API and ``cw geometry --only NAME`` run it into tables.json, tables.md, per_layer.csv
    and a figure file, and the run folder loads back."""
    import matplotlib.pyplot as plt

    from contribution_weights.experiments.geometry import (
        ANALYSES_REGISTRY,
        Analysis,
        GeometryResult,
        register_analysis,
    )
    from contribution_weights.experiments.stats import LayerMeans
    from contribution_weights.presentation.geometry_plots import (
        register_geometry_figure,
        unregister_geometry_figure,
    )

    class MeanValueNorm(LayerMeans):
        columns = ("value_norm",)

        def observe(self, view):
            self._seq[view.layer, 0] += float(view.value_norm.mean()) * view.alpha.shape[1]
            self._seq_n[view.layer, 0] += view.alpha.shape[1]

    class ValueNorm(Analysis):
        name = "value_norm"

        def stats(self, num_layers, num_heads, options):
            return {"value_norm": MeanValueNorm(num_layers)}

        def build(self, ctx):
            stat = ctx.stats["value_norm"]
            return pd.DataFrame(stat.by_layer(), ctx.layers, ["value_norm"])

        def to_json(self, table):
            return {"value_norm": table["value_norm"].tolist()}

        def per_layer(self, table):
            return table

        def markdown(self, table, result):
            return ["## Mean value norm", "", table.to_string(), ""]

    def draw(table, title=""):
        fig, ax = plt.subplots()
        table.plot(ax=ax, title=title)
        return fig

    register_analysis(ValueNorm())
    register_geometry_figure("value_norm", draw)
    try:
        lm = tiny_model("llama")
        res = geometry_run.run_geometry(lm, TEXTS, tmp_path, "value_norm,entropy", OPTS,
                                        progress=False)  # fmt: skip
        assert set(res.tables) == {"value_norm", "entropy"} and res.value_norm is not None
        assert res.value_norm is res.tables["value_norm"] and res.norm_fit is None
        tables = json.loads((tmp_path / "tables.json").read_text())
        assert tuple(tables)[: len(JSON_KEYS)] == JSON_KEYS and tables["entropy"] is not None
        assert len(tables["value_norm"]) == lm.num_layers and tables["regression_r2"] is None
        assert all(v > 0 for v in tables["value_norm"])
        assert [p.name for p in write_figures(res, tmp_path)] == ["geometry-value_norm.png"]
        assert "## Mean value norm" in write_markdown(res, tmp_path / "tables.md", "tiny")
        with pytest.raises(ValueError, match=r"valid analyses: .*value_norm"):
            geometry_run.resolve_analyses("nope")

        # the command line runs it by name, into every output file
        monkeypatch.setattr("contribution_weights.loading.load_model", lambda *a, **k: lm)
        corpus = tmp_path / "texts.jsonl"
        corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
        out = tmp_path / "cli"
        assert main(["geometry", "--texts", str(corpus), "--only", "value_norm",
                     "--out", str(out)]) == 0  # fmt: skip
        tables = json.loads((out / "tables.json").read_text())
        assert tuple(tables) == (*JSON_KEYS, "value_norm")
        assert all(tables[k] is None for k in JSON_KEYS)
        assert len(tables["value_norm"]) == lm.num_layers
        assert "## Mean value norm" in (out / "tables.md").read_text()
        assert sorted(p.name for p in out.glob("*.png")) == ["geometry-value_norm.png"]
        per_layer = pd.read_csv(out / "per_layer.csv", index_col="layer")
        assert list(per_layer.columns) == ["sink_rate", "value_norm"]
        loaded = GeometryResult.load(out)
        assert loaded.analyses == ["value_norm"] and loaded.to_json() == tables
    finally:
        ANALYSES_REGISTRY.unregister("value_norm")
        unregister_geometry_figure("value_norm")


def test_one_text_warns_when_sink_scaling_needs_standard_errors(tmp_path, monkeypatch, capsys):
    import warnings

    from contribution_weights.experiments.result import FewSamplesWarning

    lm = tiny_model("llama")
    with pytest.warns(FewSamplesWarning, match=r"only 1 text: .*ppl_se"):
        res = geometry_run.run_geometry(lm, TEXTS[:1], None, options=OPTS, progress=False)
    assert res.sink_scaling is not None and res.sink_scaling.table["ppl_se"].isna().all()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FewSamplesWarning)  # no errors over texts asked for
        geometry_run.run_geometry(lm, TEXTS[:1], None, ["entropy"], OPTS, progress=False)

    monkeypatch.setattr("contribution_weights.loading.load_model", lambda *a, **k: lm)
    f = tmp_path / "one.txt"
    f.write_text(TEXTS[0])
    capsys.readouterr()
    assert main(["geometry", "--file", str(f), "--sink-layers", "1", "--gammas", "1,0",
                 "--out", str(tmp_path / "o")]) == 0  # fmt: skip
    printed = capsys.readouterr()
    assert "cw geometry: warning: only 1 text:" in printed.err
    # the last line names every file written, figures and run files included
    files = sorted(p.name for p in (tmp_path / "o").iterdir() if p.is_file())
    assert {"config.json", "tables.json", "tables.md", "per_layer.csv"} <= set(files)
    assert any(name.endswith(".png") for name in files)
    assert printed.out.splitlines()[-1] == f"wrote {tmp_path / 'o'}/{', '.join(files)}"


def test_run_reports_each_null_beside_its_statistic(tmp_path):
    """New keys only, inside the analyses' entries: the norm fit's quality and its null,
    the alignment's and the cone's permutation nulls, the scaling's control curve (whose
    γ = 1 row is the clean perplexity); a folder without its state loads them back."""
    from contribution_weights.experiments.geometry import GeometryResult

    lm = tiny_model("llama")
    res = geometry_run.run_geometry(lm, TEXTS, tmp_path / "run", options=OPTS, progress=False)
    tables = json.loads((tmp_path / "run" / "tables.json").read_text())
    assert tuple(tables) == JSON_KEYS
    fit = tables["norm_fit"]
    assert {"fraction_convex", "fraction_r2_above_0.5", "median_r2"} <= set(fit["summary"])
    assert fit["null"]["summary"]["heads"] == fit["summary"]["heads"] == len(fit["null"]["heads"])
    assert 0 <= fit["null"]["summary"]["fraction_convex"] <= 1
    heads = res.norm_fit_null
    assert heads is not None and heads["n"].sum() < res.norm_fit["n"].sum()  # queries i ≥ c
    for key, p_value in (("sink_alignment", "p_value"), ("semantic_cone", "low_p_value")):
        null = tables[key]["null"]
        assert len(null["by_layer"]) == lm.num_layers and 0 < null["overall"][p_value] <= 1
        assert null["alternative"] in ("less", "greater") and "random" in null["token"]
    scaling = tables["sink_scaling"]
    assert [r["gamma"] for r in scaling["control"]["by_gamma"]] == list(OPTS.gammas)
    assert scaling["control"]["by_gamma"][0] == scaling["by_gamma"][0]  # γ = 1: the clean pass
    rows = pd.read_csv(tmp_path / "run" / "sink_scaling.csv")
    assert list(rows.columns) == ["seq", "gamma", "nll", "scaled", "position"]
    assert len(rows) == 2 * len(OPTS.gammas) * len(TEXTS)
    control = rows[rows["scaled"] == "control"]
    assert (control.groupby("seq")["position"].nunique() == 1).all()  # one token per text
    assert (control["position"] >= 1).all() and (
        rows[rows["scaled"] == "sink"]["position"] == 0
    ).all()
    md = write_markdown(res, tmp_path / "run" / "tables.md", "tiny")
    assert md.count("Null:") == 3 and "Control: the same γ" in md

    (tmp_path / "run" / "state.pt").unlink()  # a published folder keeps no state
    loaded = GeometryResult.load(tmp_path / "run")
    _close(loaded.to_json(), tables)
    assert write_markdown(loaded, tmp_path / "again.md", "tiny") == md
    assert loaded.sink_alignment_null is not None and loaded.semantic_cone_null is not None


def test_a_state_written_before_the_nulls_loads_without_them(tmp_path):
    """A run folder from before the nulls (no null statistics in state.pt, no control rows
    in sink_scaling.csv) loads with its tables as they were, and no nulls: none that
    covers only some of its texts."""
    import torch

    from contribution_weights.experiments.geometry import GeometryResult

    lm = tiny_model("llama")
    run = tmp_path / "run"
    res = geometry_run.run_geometry(lm, TEXTS, run, options=OPTS, progress=False)
    state = torch.load(run / "state.pt", weights_only=True)
    del state["stats"]["norm_fit_null"]
    for key in ("null_total", "null_count", "null_sequences"):
        del state["stats"]["sink_alignment"][key]
    for key in ("null_counts", "null_sequences"):
        del state["stats"]["semantic_cone"][key]
    torch.save(state, run / "state.pt")
    rows = pd.read_csv(run / "sink_scaling.csv")
    rows = rows[rows["scaled"] == "sink"].drop(columns=["scaled", "position"])
    rows.to_csv(run / "sink_scaling.csv", index=False)
    old = GeometryResult.load(run)
    assert old.norm_fit_null is None and old.sink_alignment_null is None
    assert old.semantic_cone_null is None and old.sink_scaling.control is None
    new, before = res.to_json(), old.to_json()
    for key in ("sink_alignment", "semantic_cone", "norm_fit"):
        assert "null" in new[key] and "null" not in before[key]
        assert {k: v for k, v in new[key].items() if k != "null"} == before[key]
    assert "control" not in before["sink_scaling"]
    assert before["sink_scaling"]["by_gamma"] == new["sink_scaling"]["by_gamma"]
