"""The README's and docs' marked tables are what their run folders' files give."""

from __future__ import annotations

from pathlib import Path

import pytest

from contribution_weights import generated

REPO = Path(__file__).resolve().parents[1]


def test_every_marked_table_matches_its_run():
    assert "docs/results/bench-trace/bench_trace-smollm2-t1.md" in generated.sources(REPO)
    assert generated.stale(REPO) == [], "rerun `cw results` and commit the pages it rewrote"


def _repo(tmp_path: Path, table: str) -> Path:
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "run.md").write_text(
        "Machine: x\n\n| a | b |\n| --- | ---: |\n| one | 1.50 |\n"
    )
    (tmp_path / "README.md").write_text(
        "# t\n\nText.\n\n<!-- generated: docs/results/run.md (table) -->\n"
        f"{table}<!-- end generated -->\n\nMore text.\n"
    )
    return tmp_path


def test_a_table_typed_beside_its_run_is_found_and_rewritten(tmp_path):
    repo = _repo(tmp_path, "| a | b |\n| --- | ---: |\n| one | 1.49 |\n")  # a typed-in 1.49
    assert generated.stale(repo) == [repo / "README.md"]
    assert generated.refresh(repo) == [repo / "README.md"]
    text = (repo / "README.md").read_text()
    assert "| one | 1.50 |" in text and "1.49" not in text and text.endswith("More text.\n")
    assert "Machine" not in text  # the table only, not the file's other lines
    assert generated.stale(repo) == [] and generated.refresh(repo) == []


def test_a_block_naming_a_missing_file_says_which(tmp_path):
    repo = _repo(tmp_path, "")
    (repo / "docs" / "results" / "run.md").unlink()
    with pytest.raises(generated.GeneratedError, match=r"run\.md: no such file"):
        generated.stale(repo)


def test_a_whole_file_block_and_the_handwritten_count(tmp_path):
    repo = _repo(tmp_path, "")
    page = repo / "docs" / "page.md"
    page.write_text("# p\n<!-- generated: docs/results/run.md -->\nold\n<!-- end generated -->\n")
    assert generated.refresh(repo) == [repo / "README.md", page]
    text = page.read_text()
    assert "Machine: x\n\n| a | b |" in text  # the whole file, its header included
    assert generated.handwritten_lines(text) == 3


def test_a_csv_block_is_its_rows_as_a_table(tmp_path):
    repo = _repo(tmp_path, "")
    (repo / "docs" / "results" / "summary.csv").write_text(
        "measure,n,nll_mean\nattention,32,0.123456789\nihc,32,-1.5e-05\n"
    )
    page = repo / "docs" / "page.md"
    page.write_text(
        "<!-- generated: docs/results/summary.csv columns=measure,nll_mean -->\n"
        "<!-- end generated -->\n"
    )
    generated.refresh(repo)
    assert page.read_text().splitlines()[1:-1] == [
        "| measure | nll_mean |",
        "| --- | ---: |",
        "| attention | 0.1235 |",
        "| ihc | -1.5e-05 |",
    ]
    page.write_text(
        "<!-- generated: docs/results/summary.csv columns=nope -->\n<!-- end generated -->\n"
    )
    with pytest.raises(generated.GeneratedError, match="no column nope"):
        generated.refresh(repo)


def test_the_front_page_and_each_docs_page_stay_readable():
    """README ≤ 250 lines; each docs page ≤ 600 lines of hand-written text (its generated
    blocks apart)."""
    assert len((REPO / "README.md").read_text().splitlines()) <= 250
    for page in sorted((REPO / "docs").glob("*.md")):
        written = generated.handwritten_lines(page.read_text())
        assert written <= 600, f"{page.name}: {written} hand-written lines (at most 600)"


def test_a_numbered_table_block_takes_only_that_table(tmp_path):
    repo = _repo(tmp_path, "")
    (repo / "docs" / "results" / "run.md").write_text(
        "Machine: x\n\n| a |\n| --- |\n| 1 |\n\nSecond:\n\n| b |\n| --- |\n| 2 |\n"
    )
    page = repo / "docs" / "page.md"
    page.write_text(
        "<!-- generated: docs/results/run.md (table 2) -->\n<!-- end generated -->\n"
        "<!-- generated: docs/results/run.md (table 1) -->\n<!-- end generated -->\n"
    )
    generated.refresh(repo)
    assert page.read_text().splitlines() == [
        "<!-- generated: docs/results/run.md (table 2) -->",
        "| b |",
        "| --- |",
        "| 2 |",
        "<!-- end generated -->",
        "<!-- generated: docs/results/run.md (table 1) -->",
        "| a |",
        "| --- |",
        "| 1 |",
        "<!-- end generated -->",
    ]
    page.write_text("<!-- generated: docs/results/run.md (table 3) -->\n<!-- end generated -->\n")
    with pytest.raises(generated.GeneratedError, match="holds 2 Markdown tables, not 3"):
        generated.refresh(repo)


def test_a_json_block_is_one_row_per_key(tmp_path):
    (tmp_path / "summary.json").write_text(
        '{"attention": {"entropy": 1.41279, "first": 0.5}, "vw": {"entropy": 2.0, "first": 1}}'
    )
    page = tmp_path / "README.md"
    page.write_text(
        "<!-- generated: summary.json columns=first,entropy -->\nstale\n<!-- end generated -->\n"
    )
    assert generated.refresh(tmp_path) == [page]
    assert page.read_text().splitlines()[1:5] == [
        "|  | first | entropy |",
        "| --- | ---: | ---: |",
        "| attention | 0.5 | 1.413 |",
        "| vw | 1 | 2 |",
    ]
    (tmp_path / "summary.json").write_text("[1, 2]")
    with pytest.raises(generated.GeneratedError, match="object of objects"):
        generated.refresh(tmp_path)
