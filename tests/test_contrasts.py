"""Paired contrasts across runs: the committed tables are what the runs' paired files give,
a pair stored the other way round is turned round, and a missing run or pair is named."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from contribution_weights.cli import main
from contribution_weights.experiments import contrasts

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
HEADER = ["task", "ratio", "reference", "other", "mean", "se", "ci_low", "ci_high", "verdict"]


def test_every_committed_contrast_table_is_what_its_runs_give():
    folders = contrasts.contrast_folders(RESULTS)
    assert folders, "no contrasts.json under docs/results"
    for folder in folders:
        assert contrasts.differences(folder) == [], f"rerun `cw results`: {folder.name}"


def _run(root: Path, name: str, rows: list[list[object]]) -> None:
    (root / name).mkdir(parents=True)
    with (root / name / "summary_pairs.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(HEADER)
        writer.writerows(rows)


def _spec(root: Path, table: dict) -> Path:
    folder = root / "contrasts"
    folder.mkdir()
    (folder / contrasts.SPEC).write_text(json.dumps({"tables": [table]}))
    return folder


def _table(**changes) -> dict:
    table = {
        "name": "t",
        "file": "summary_pairs.csv",
        "folder": "run-{model}",
        "where": {"reference": "a", "other": "b"},
        "corner": "model",
        "rows": [{"label": "one", "vars": {"model": "one"}}],
        "columns": [{"label": "0.5", "where": {"ratio": 0.5}}],
    }
    return {**table, **changes}


def test_a_pair_stored_the_other_way_round_is_turned_round(tmp_path):
    _run(
        tmp_path, "run-one", [["lm", "0.50", "b", "a", -0.25, 0.01, -0.3, -0.2, "reference better"]]
    )
    folder = _spec(tmp_path, _table(cell="interval", digits=2))
    assert contrasts.render(folder)["t.md"].splitlines()[2] == "| one | **+0.25 [+0.20, +0.30]** |"
    folder = tmp_path / "again"
    _run(folder, "run-one", [["lm", "0.5", "a", "b", 0.004, 0.002, -0.001, 0.009, "tie"]])
    assert (
        contrasts.render(_spec(folder, _table()))["t.md"].splitlines()[2]
        == "| one | +0.004 ± 0.002 |"
    )


def test_signs_name_each_verdict_in_the_groups_given(tmp_path):
    verdicts = {"b": "reference better", "c": "other better", "d": "tie"}
    _run(tmp_path, "run-one", [["lm", 0.5, "a", o, 0, 0, 0, 0, v] for o, v in verdicts.items()])
    folder = _spec(
        tmp_path, _table(cell="signs", others=[["b", "c"], ["d"]], where={"reference": "a"})
    )
    assert contrasts.render(folder)["t.md"].splitlines()[1:] == [
        "| --- | --- |",
        "| one | + − · = |",
    ]


def test_cw_results_writes_a_contrast_and_check_names_it_when_it_drifts(tmp_path, capsys):
    results = tmp_path / "docs" / "results"
    _run(results, "run-one", [["lm", 0.5, "a", "b", 0.5, 0.1, 0.3, 0.7, "reference better"]])
    folder = _spec(results, _table())
    assert main(["results", str(tmp_path)]) == 0
    assert (folder / "t.md").read_text().endswith("| one | **+0.500 ± 0.100** |\n")
    assert main(["results", str(tmp_path), "--check"]) == 0
    (folder / "t.md").write_text("typed by hand\n")
    assert main(["results", str(tmp_path), "--check"]) == 1
    assert "differs: docs/results/contrasts: t.md" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([], "has no row matching"),
        ([["lm", 0.5, "a", "b", 0, 0, 0, 0, "tie"]] * 2, "2 rows match"),
    ],
)
def test_a_missing_or_ambiguous_pair_is_named(tmp_path, rows, message):
    _run(tmp_path, "run-one", rows)
    with pytest.raises(contrasts.ContrastError, match=message):
        contrasts.render(_spec(tmp_path, _table()))


def test_a_missing_run_folder_is_named(tmp_path):
    with pytest.raises(contrasts.ContrastError, match=r"run-one/summary_pairs\.csv does not exist"):
        contrasts.render(_spec(tmp_path, _table()))
