"""A package's public names imported from its submodules on first use (PEP 562), so that
importing the package (for its light names, or to build the command line) loads nothing
heavy."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: name ``n`` is read from the submodule
    ``exports[n]`` (relative to ``package``) on first use and kept in ``namespace`` (the
    package's ``globals()``), so later lookups do not come back here."""

    def getattr_(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *exports})

    return getattr_, dir_
