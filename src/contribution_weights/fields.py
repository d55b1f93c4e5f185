"""Options declared once: dataclass fields that carry their own command-line description.

An option is a dataclass field made with :func:`option`: its default, its help text, its
command-line flag (and deprecated aliases) and how the flag's text is parsed. An options
class validates itself in ``__post_init__`` (:class:`Options`), so the Python API and ``cw``
raise the same :class:`ValueError` for the same bad value, and ``cli/options.py`` generates
the ``argparse`` arguments from the fields. Pure Python (layer 0): experiments' and
attribution's options are both built on it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

#: how a flag's text becomes a value (the CLI maps each kind to an argparse type)
PARSE_KINDS = ("str", "int", "float", "names", "floats", "ints", "flag", "no-flag")


def option(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    parse: str = "str",
    aliases: Sequence[str] = (),
    choices: Sequence[str] | None = None,
    metavar: str | None = None,
) -> Any:
    """A dataclass field with its CLI description (``flag=None``: API only).

    ``parse`` is one of :data:`PARSE_KINDS`; ``"flag"`` is a switch that sets True,
    ``"no-flag"`` one that sets False (e.g. ``--no-sink-protection``). ``aliases`` are
    older spellings of the flag, accepted and reported as deprecated.
    """
    if parse not in PARSE_KINDS:
        raise ValueError(f"unknown parse kind {parse!r}; choose from {', '.join(PARSE_KINDS)}")
    meta = {
        "help": help,
        "flag": flag,
        "parse": parse,
        "aliases": tuple(aliases),
        "choices": None if choices is None else tuple(choices),
        "metavar": metavar,
    }
    if isinstance(default, list | tuple):
        frozen = tuple(default)
        return dataclasses.field(default_factory=lambda: list(frozen), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


class Options:
    """Base of experiment options: dataclasses that check and normalise themselves.

    Subclasses are ``@dataclass`` and implement :meth:`validate`, which raises
    :class:`ValueError` naming the bad value and the fix, and may normalise fields (a
    string ``"a,b"`` into a list, rates sorted). :meth:`to_dict` is the JSON form
    stored in a run's ``config.json``.
    """

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:  # pragma: no cover - every subclass overrides it
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, list | tuple) else value
        return out

    def replace(self, **changes: Any) -> Any:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


def split_names(value: str | Sequence[str]) -> list[str]:
    """``"a,b"`` or ``["a", "b"]`` -> ``["a", "b"]`` (a string is never split into letters)."""
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return [str(v) for v in value]


def as_floats(value: float | str | Sequence[float]) -> list[float]:
    """One number, ``"0.1,0.5"`` or a sequence of numbers as a list of floats."""
    if isinstance(value, int | float):
        return [float(value)]
    parts: Sequence[Any] = value.split(",") if isinstance(value, str) else value
    try:
        return [float(v) for v in parts if not isinstance(v, str) or v.strip()]
    except (TypeError, ValueError):
        raise ValueError(f"expected numbers like 0.1,0.5, not {value!r}") from None


def as_ints(value: int | str | Sequence[int]) -> list[int]:
    """One integer, ``"0,5,-1"`` or a sequence of integers as a list of ints."""
    if isinstance(value, int):
        return [value]
    parts: Sequence[Any] = value.split(",") if isinstance(value, str) else value
    try:
        return [int(v) for v in parts if not isinstance(v, str) or v.strip()]
    except (TypeError, ValueError):
        raise ValueError(f"expected whole numbers like 0,5,-1, not {value!r}") from None


def int_ranges(items: Sequence[int], *, dash: str = "-", least: int = 2) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"`` (the inverse of a ``--layers`` list):
    runs of ``least`` or more consecutive numbers as ranges joined by ``dash``, shorter
    runs number by number."""
    runs: list[list[int]] = []
    for x in items:
        if runs and x == runs[-1][-1] + 1:
            runs[-1].append(x)
        else:
            runs.append([x])
    return ", ".join(
        f"{r[0]}{dash}{r[-1]}" if len(r) >= least else ", ".join(map(str, r)) for r in runs
    )


def as_bytes(value: int | float | str) -> int:
    """A size in bytes: a number, or text such as ``"8G"``, ``"512M"``, ``"1.5GB"`` (decimal
    units) or ``"8GiB"`` (binary: 2³⁰)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size like 8G, 512M or a number of bytes, not {value!r}")
    if isinstance(value, int | float):
        number, scale = float(value), 1.0
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?)[bB]?\s*", str(value))
        if match is None or (match[3] and not match[2]):
            raise ValueError(f"expected a size like 8G, 512M, 1.5GB or 8GiB, not {value!r}")
        unit = match[2].lower()
        power = "kmgt".index(unit) + 1 if unit else 0  # 0: bytes
        number, scale = float(match[1]), float((1024 if match[3] else 1000) ** power)
    if not math.isfinite(number * scale) or number * scale < 1:
        raise ValueError(f"the size must be a positive, finite number of bytes, not {value!r}")
    return int(number * scale)


# ---- the experiments' options ------------------------------------------------------------
