"""The package's layering (its docstring) holds: every import, lazy ones inside functions
included, points down the layers, save the sanctioned facade methods named below."""

from __future__ import annotations

import ast
from pathlib import Path

import contribution_weights

PACKAGE = Path(contribution_weights.__file__).parent
LAYERS = [
    {"registry", "defaults", "fields", "generated", "lazy"},
    {"families", "measures", "progress", "runs", "data", "tracing.storage", "tracing.folder"},
    {"capture", "loading", "tracing.maps", "tracing.format", "tracing.query", "tracing.result"},
    {"interventions", "inputs", "kv"},
    {"attribution"},
    {"tracing", "experiments"},
    {"presentation"},
    {"cli"},
    {"__init__", "__main__"},
]
#: lazy (in-function) upward imports allowed: none (results know nothing of their figures)
FACADES: set[tuple[str, str]] = set()


def _layer(part: str) -> int:
    for i, names in enumerate(LAYERS):
        if part in names:
            return i
    raise AssertionError(f"{part} is in no layer: add it to LAYERS and the package docstring")


def _unit(parts: list[str]) -> str:
    """The layered unit of a module path: ``tracing.storage`` where a package is split over
    layers module by module, else the top-level part (``measures``)."""
    parts = [p for p in parts if p != "__init__"]
    if not parts:
        return "__init__"
    sub = ".".join(parts[:2])
    return sub if any(sub in names for names in LAYERS) else parts[0]


def _imports(path: Path) -> list[tuple[str, bool, int]]:
    """(unit imported, inside a function, line) for every in-package import."""
    rel = path.relative_to(PACKAGE).with_suffix("")
    here = list(rel.parts[:-1])  # the module's package, relative to contribution_weights
    tree = ast.parse(path.read_text())
    out = []
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    lazy = {id(n) for f in functions for n in ast.walk(f)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
                target = [*base, *(node.module.split(".") if node.module else [])]
                if not node.module:  # "from . import data": the names are the modules
                    for alias in node.names:
                        out.append((_unit([*target, alias.name]), id(node) in lazy, node.lineno))
                    continue
            elif node.module and node.module.split(".")[0] == "contribution_weights":
                target = node.module.split(".")[1:]
            else:
                continue
            out.append((_unit(target), id(node) in lazy, node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "contribution_weights":
                    out.append((_unit(parts[1:]), id(node) in lazy, node.lineno))
    return out


def test_every_import_points_down_the_layers():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        me = _unit(list(rel.with_suffix("").parts))
        for target, lazy, line in _imports(path):
            if target == me:
                continue
            same_package = target.split(".")[0] == me.split(".")[0]
            if _layer(target) < _layer(me) or (same_package and _layer(target) <= _layer(me)):
                continue
            if lazy and (me, target) in FACADES:
                continue
            wrong.append(f"{rel}:{line} imports {target} ({'lazily' if lazy else 'at the top'})")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_the_checker_sees_lazy_and_relative_imports(tmp_path, monkeypatch):
    """The checker itself: a lazy upward import inside a function is reported."""
    sub = tmp_path / "pkg" / "measures"
    sub.mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (sub / "x.py").write_text("def f():\n    from ..cli import main\n    from . import y\n")
    monkeypatch.setattr(f"{__name__}.PACKAGE", tmp_path / "pkg")
    assert _imports(sub / "x.py") == [("cli", True, 2), ("measures", True, 3)]


def test_no_caller_switches_on_the_class_behind_a_protocol():
    """Map stores are used through MapStore alone: ``isinstance(x, DenseMaps)`` outside
    storage.py would mean the protocol lacks a method."""
    concrete = {"DenseMaps", "PackedMaps", "LegacyMaps"}
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "storage.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "isinstance"
                and len(node.args) == 2
            ):
                names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                if names & concrete:
                    wrong.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not wrong, "switches on a map store's class:\n" + "\n".join(wrong)


def test_a_package_split_over_layers_is_checked_module_by_module(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg" / "tracing"
    pkg.mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (pkg / "storage.py").write_text("from .run import trace\nfrom ..measures import x\n")
    (pkg / "result.py").write_text("from .maps import MeasureMap\nfrom .storage import y\n")
    monkeypatch.setattr(f"{__name__}.PACKAGE", tmp_path / "pkg")
    assert _imports(pkg / "storage.py") == [("tracing", False, 1), ("measures", False, 2)]
    want = [("tracing.maps", False, 1), ("tracing.storage", False, 2)]
    assert _imports(pkg / "result.py") == want
    assert _layer("tracing.storage") < _layer("tracing.result") < _layer("tracing")
