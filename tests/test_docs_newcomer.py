"""The documented first steps work: every page that documents an experiment shows how to
run it offline on the data fixtures shipped in tests/fixtures/data, and each such
command parses, finds its data there and runs (on a tiny model instead of SmolLM2)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from tiny_models import tiny_model

from contribution_weights import data

REPO = Path(__file__).resolve().parents[1]
FIXTURES = "tests/fixtures/data"
PAGES = ["README.md", "docs/experiments.md", "docs/faithfulness.md", "docs/geometry.md",
         "docs/kv-cache.md"]  # fmt: skip


def try_commands(page: str) -> list[list[str]]:
    """The page's `cw ...` lines that write to runs/try-*: its offline first steps."""
    out = []
    for line in (REPO / page).read_text().splitlines():
        if line.startswith("cw ") and "runs/try-" in line:
            out.append(shlex.split(line.split("  #")[0])[1:])
    return out


@pytest.mark.parametrize("page", PAGES)
def test_each_page_shows_an_offline_run_on_the_shipped_fixtures(page):
    text = (REPO / page).read_text()
    assert f"--data-dir {FIXTURES}" in text
    assert try_commands(page), f"{page} has no `cw ... --out runs/try-...` command"


ALL = sorted({tuple(argv) for page in PAGES for argv in try_commands(page)})


def test_every_experiment_has_an_offline_first_step():
    assert {argv[0] for argv in ALL} == {"faithfulness", "downstream", "geometry", "kv-eval"}


@pytest.mark.filterwarnings("ignore:sink-value scaling skipped")  # a random tiny model
@pytest.mark.parametrize("argv", ALL, ids=[" ".join(a[:3]) for a in ALL])
def test_documented_offline_command_finds_its_data_and_runs(argv, tmp_path, monkeypatch):
    from contribution_weights.cli import build_parser, main

    monkeypatch.chdir(REPO)  # the commands name the fixtures relative to the repository
    monkeypatch.delenv("CW_DATA_DIR", raising=False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    name = getattr(args, "dataset", None) or (args.task if args.task in data.TASKS else None)
    if getattr(args, "data_dir", None) is not None:
        assert str(args.data_dir) == FIXTURES and name is not None
        files = sorted(Path(FIXTURES).glob(data.LAYOUT[name]))
        assert files, f"{FIXTURES} has no {data.LAYOUT[name]}"
    else:  # only kv-eval's passkey task needs no data
        assert argv[0] == "kv-eval" and args.task == "passkey"
    lm = tiny_model("llama")
    monkeypatch.setattr("contribution_weights.loading.load_model", lambda *a, **k: lm)
    out = tmp_path / "run"
    argv = [str(out) if a.startswith("runs/try-") else a for a in argv]
    assert main(argv) == 0
    assert (out / "config.json").is_file() and (out / "run_info.json").is_file()


def test_the_readme_states_both_first_load_times_and_the_cached_one():
    text = " ".join((REPO / "README.md").read_text().split())
    first = re.search(
        r"SmolLM2 took (\d+) s and Gemma 3 270M \(`--model gemma3-270m`\) (\d+) s", text
    )
    assert first and "Later loads read the cache" in text
