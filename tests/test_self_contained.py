"""The project stands on its own: nothing a user reads points outside the repository.

The package (code, docstrings, error messages, assets), the README, the docs and the
examples may not name paths that exist only beside this checkout (the maintainers'
shared data folder or specification). The method is in docs/method.md; data layouts are
in docs/method.md and ``cw.data.LAYOUT``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "src" / "contribution_weights"
FORBIDDEN = re.compile(r"\.\./shared|shared/data|shared/SPEC|SPEC\.md|STYLE\.md|\bSPEC §")
TEXT_SUFFIXES = {".py", ".md", ".txt", ".js", ".css", ".html", ".ipynb", ".toml", ".cfg", ".json"}


def _user_facing_files() -> list[Path]:
    files = [p for p in PACKAGE.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES]
    files += [REPO / "README.md", REPO / "pyproject.toml"]
    files += [p for p in (REPO / "docs").rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES]
    files += [p for p in (REPO / "examples").rglob("*") if p.is_file()]
    return [p for p in files if "__pycache__" not in p.parts]


def test_the_checker_sees_the_files_and_catches_a_reference():
    files = {p.relative_to(REPO).as_posix() for p in _user_facing_files()}
    assert {"README.md", "docs/method.md", "src/contribution_weights/data.py"} <= files
    assert "examples/quickstart.ipynb" in files
    assert FORBIDDEN.search("see ../shared/SPEC.md §4") and FORBIDDEN.search("(SPEC §2)")
    assert not FORBIDDEN.search("see docs/method.md §4; data shared by tests")


@pytest.mark.parametrize("path", _user_facing_files(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_reference_outside_the_repository(path):
    hits = [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for n, line in enumerate(path.read_text("utf-8", errors="replace").splitlines(), 1)
        if FORBIDDEN.search(line)
    ]
    assert not hits, "points outside the repository (use docs/method.md):\n" + "\n".join(hits)


def test_the_method_covers_what_the_code_implements():
    method = (REPO / "docs" / "method.md").read_text("utf-8")
    for needed in (
        "## 2. Per-layer measures",
        "## 3. Aggregates",
        "## 4. Faithfulness",
        "## 5. Value geometry and attention sinks",
        "Sink tokens",
        "Ranking scope",
        "Downstream tasks",
        "Sink-value scaling",
        "## Evaluation data",
    ):
        assert needed in method, needed
    from contribution_weights.measures.registry import measure_names

    for name in measure_names():
        assert f"`{name}`" in method, f"measure {name} is not defined in docs/method.md"


def test_docs_links_resolve():
    """Relative links in the README and docs point at files that exist."""
    missing = []
    for doc in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text("utf-8")):
            if "://" in target:
                continue
            if not (doc.parent / target).exists():
                missing.append(f"{doc.relative_to(REPO)} -> {target}")
    assert not missing, missing


def _heading_slugs(markdown: str) -> set[str]:
    """The anchors GitHub gives a document's headings: lower case, punctuation and symbols
    dropped (letters, digits, ``_``, ``-`` and spaces kept), spaces as ``-``; repeats get
    ``-1``, ``-2``, …"""
    slugs: set[str] = set()
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not re.match(r"#{1,6} ", line):
            continue
        text = re.sub(r"`([^`]*)`", r"\1", line.lstrip("#").strip())
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text only
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        base, k = slug, 0
        while slug in slugs:
            k += 1
            slug = f"{base}-{k}"
        slugs.add(slug)
    return slugs


def test_docs_anchors_resolve():
    """Links to a heading (``doc.md#anchor``, ``#anchor``) in the README and docs name a
    heading that exists."""
    docs = [REPO / "README.md", *(REPO / "docs").glob("*.md")]
    slugs = {doc.resolve(): _heading_slugs(doc.read_text("utf-8")) for doc in docs}
    missing = []
    for doc in docs:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", doc.read_text("utf-8")):
            if "://" in target or not (target == "" or target.endswith(".md")):
                continue
            path = (doc.parent / target).resolve() if target else doc.resolve()
            if path in slugs and anchor not in slugs[path]:
                missing.append(f"{doc.relative_to(REPO)} -> {target}#{anchor}")
    assert not missing, missing


def test_licence_is_an_spdx_expression():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text("utf-8"))
    assert project["project"]["license"] == "Apache-2.0"  # a string, not a table
    requires = " ".join(project["build-system"]["requires"])
    found = re.search(r"setuptools>=(\d+)", requires)
    assert found and int(found.group(1)) >= 77, "SPDX licence strings need setuptools 77+"
    from importlib.metadata import metadata

    assert metadata("contribution-weights").get("License-Expression") == "Apache-2.0"
