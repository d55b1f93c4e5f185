"""Command-line arguments generated from an experiment's options dataclass.

Each field made with :func:`~..experiments.options.option` and a ``flag`` becomes one
argument: its help (with the dataclass default), its parser, its choices and its
deprecated aliases. Values not given on the command line are left out, so the
dataclass default applies; the dataclass validates the values, so ``cw`` reports the
same errors as the Python API.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any, TypeVar

from .common import parse_int_list

T = TypeVar("T")


def _names(value: str) -> list[str]:
    return [x.strip() for x in value.replace(" ", ",").split(",") if x.strip()]


def _floats(value: str) -> list[float]:
    try:
        return [float(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,0.5,0, not {value!r}") from None


def _number(kind: type) -> Any:
    def parse(value: str) -> Any:
        try:
            return kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, not {value!r}") from None

    parse.__name__ = kind.__name__
    return parse


PARSERS: dict[str, Any] = {
    "str": str,
    "int": _number(int),
    "float": _number(float),
    "names": _names,
    "floats": _floats,
    "ints": parse_int_list,
}


class _Deprecated(argparse.Action):
    """An older spelling of a flag: stores the value and says which flag replaces it."""

    def __init__(self, *args: Any, new_flag: str = "", parse: Any = str, **kwargs: Any) -> None:
        self.new_flag, self.parse = new_flag, parse
        super().__init__(*args, **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        print(f"warning: {option_string} is deprecated; use {self.new_flag}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _default_text(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return ""
    if isinstance(value, bool) or value is None:  # None: the help says what happens
        return ""
    if isinstance(value, list | tuple):
        value = ",".join(map(str, value))
    return f" (default {value})"


def add_options(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Add an argument for every field of the options dataclass ``cls`` that has a flag."""
    for f in dataclasses.fields(cls):
        meta = f.metadata
        flag = meta.get("flag")
        if not flag or f.name in skip:
            continue
        kind = meta["parse"]
        if kind in ("flag", "no-flag"):
            action = "store_true" if kind == "flag" else "store_false"
            parser.add_argument(
                flag, dest=f.name, action=action, default=argparse.SUPPRESS, help=meta["help"]
            )
            continue
        parse = PARSERS[kind]
        parser.add_argument(
            flag,
            dest=f.name,
            type=parse,
            choices=meta["choices"],
            metavar=meta["metavar"],
            default=argparse.SUPPRESS,
            help=meta["help"] + _default_text(f),
        )
        for alias in meta["aliases"]:
            parser.add_argument(
                alias,
                dest=f.name,
                type=parse,
                action=_Deprecated,
                new_flag=flag,
                default=argparse.SUPPRESS,
                help=f"deprecated spelling of {flag}",
            )


def options_from_args(cls: type[T], args: argparse.Namespace, **extra: Any) -> T:
    """The options dataclass from the parsed flags (defaults where a flag was not given)."""
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    given = {name: getattr(args, name) for name in names if hasattr(args, name)}
    return cls(**{**given, **extra})
