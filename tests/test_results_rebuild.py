"""`cw results`: every committed run's derived files are what its rows give, byte for byte;
a table that drifts from its rows is named by --check and rebuilt without it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from contribution_weights.cli import main
from contribution_weights.cli.results_cmd import _draw
from contribution_weights.experiments.geometry import compare
from contribution_weights.experiments.rebuild import differences, experiment_of, run_folders

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"
#: one committed run of each experiment and task (`cw results --check` checks them all)
KINDS = [
    "faithfulness-smollm2-fineweb-edu-512-key_mask",
    "downstream-smollm2-boolq-200-key_mask",
    "kv-smollm2-gsm8k-512",
    "kv-smollm2-passkey-512",
    "kv-renormalised-smollm2-gsm8k-512",
    "kv-ruler-gemma3-270m-4096-keydiff-sinks",
    "kv-ruler-smollm2-4096-vt-uncompressed",
    "attribution-smollm2-deletion-64",
    "attribution-gemma3-270m-passkey-128",
    "geometry-smollm2-gsm8k-512",  # rebuilt from its tables.json (its state is not kept)
]


#: the tables of every other committed faithfulness, downstream and geometry run (about a
#: second each; the kv-eval and attribution-eval runs take 2-14 s a folder, so beyond
#: KINDS `cw results --check` checks them)
TABLES = sorted(
    f.name
    for f in run_folders(RESULTS)
    if f.name.startswith(("faithfulness-", "downstream-", "geometry-")) and f.name not in KINDS
)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", TABLES)
def test_every_committed_runs_tables_are_what_its_rows_give(name):
    found = differences(RESULTS / name)
    assert found.skipped is None and found.written, found
    assert found.differing == [], f"rerun `cw results`: {name}: {found.differing}"


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", KINDS)
def test_a_committed_run_is_what_its_rows_give(name):
    found = differences(RESULTS / name, _draw)  # the tables and the figure
    assert found.skipped is None and any(f.endswith(".png") for f in found.written), found
    assert found.differing == [], f"rerun `cw results`: {name}: {found.differing}"


def test_every_run_folder_is_found_and_each_has_a_result_type_to_rebuild_it(tmp_path):
    folders = run_folders(RESULTS)
    assert {f.name for f in folders} >= set(KINDS)
    assert all(experiment_of(f) is not None for f in folders)
    stray = tmp_path / "run"
    stray.mkdir()
    (stray / "config.json").write_text('{"experiment": "no-such-experiment"}')
    assert "no result type" in str(differences(stray).skipped)


@pytest.mark.filterwarnings("ignore")
def test_cw_results_names_a_drifted_table_and_rebuilds_it(tmp_path, capsys):
    run = tmp_path / "docs" / "results" / "downstream-smollm2-winogrande"
    shutil.copytree(RESULTS / run.name, run)
    (tmp_path / "README.md").write_text("# r\n")
    summary = run / "summary.csv"
    committed = summary.read_bytes()
    summary.write_bytes(committed.replace(b"0.", b"0.9", 1))  # a number typed over
    assert main(["results", "--check", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "differs: docs/results/downstream-smollm2-winogrande: summary.csv" in out
    assert summary.read_bytes() != committed  # --check writes nothing
    assert main(["results", str(tmp_path)]) == 0
    assert summary.read_bytes() == committed
    assert main(["results", "--check", str(tmp_path)]) == 0
    assert "every table is what its rows give" in capsys.readouterr().out


def test_cw_results_outside_a_repository_says_where_to_run_it(tmp_path, capsys):
    assert main(["results", str(tmp_path)]) == 2
    assert "run it in the repository" in capsys.readouterr().err


def test_cw_results_names_a_folder_it_cannot_read_back_and_checks_the_others(tmp_path, capsys):
    repo = tmp_path / "parts" / "repo"  # a folder named parts above the repository is fine
    good = repo / "docs" / "results" / "downstream-smollm2-winogrande"
    shutil.copytree(RESULTS / good.name, good)
    (repo / "README.md").write_text("# r\n")
    broken = repo / "docs" / "results" / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    empty = repo / "docs" / "results" / "empty"
    empty.mkdir()
    (empty / "config.json").write_text('{"experiment": "faithfulness"}')  # and no rows
    assert main(["results", "--check", str(repo)]) == 2
    err = capsys.readouterr().err
    assert "broken/config.json is not valid JSON" in err
    assert "empty: its faithfulness result could not be rebuilt from its rows" in err
    assert [f.name for f in run_folders(repo / "docs" / "results")] == [
        "broken",
        "downstream-smollm2-winogrande",
        "empty",
    ]


def test_the_geometry_comparison_is_what_its_runs_give():
    folders = compare.comparison_folders(RESULTS)
    assert RESULTS / "compare-geometry" in folders
    for folder in folders:
        assert compare.differences(folder) == [], f"rerun `cw results`: {folder.name}"


@pytest.mark.filterwarnings("ignore")
def test_cw_results_names_a_drifted_comparison_table_and_rebuilds_it(tmp_path, capsys):
    results = tmp_path / "docs" / "results"
    spec = json.loads((RESULTS / "compare-geometry" / compare.SPEC).read_text())
    for group in spec["groups"]:
        for run in group["runs"]:
            for key in ("folder", "sink_scaling"):
                if run.get(key):
                    shutil.copytree(RESULTS / run[key], results / run[key])
    folder = results / "compare-geometry"
    shutil.copytree(RESULTS / "compare-geometry", folder)
    (tmp_path / "README.md").write_text("# r\n")
    table = folder / "first_token_weight.md"
    committed = table.read_text()
    table.write_text(committed.replace("0.309", "0.310"))  # a number typed over
    assert compare.differences(folder) == ["first_token_weight.md"]
    assert main(["results", "--check", str(tmp_path)]) == 1
    assert (
        "differs: docs/results/compare-geometry: first_token_weight.md" in capsys.readouterr().out
    )
    assert main(["results", str(tmp_path)]) == 0
    assert table.read_text() == committed and compare.differences(folder) == []


def test_comparison_cells_name_layer_runs_and_given_sink_layers():
    assert compare._layers([14, 17, 18, 20, 23, 24, 25, 26, 28]) == "14, 17, 18, 20, 23–26, 28"
    sinks = (RESULTS / "compare-geometry" / "sinks.md").read_text()
    assert "none (given: 5, 17)" in sinks  # Gemma on GSM8K at 512 tokens: no sink layer
