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
    """The options dataclass from the parsed flags (defaults where a flag was not given;
    ``extra`` for values that come from elsewhere, such as :func:`held_options`)."""
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    given = {name: getattr(args, name) for name in names if hasattr(args, name)}
    return cls(**{**given, **extra})


def held_options(
    cls: type,
    args: argparse.Namespace,
    held: dict[str, Any] | None,
    fixed: dict[str, Any],
    experiment: str = "",
) -> dict[str, Any]:
    """The options a resumed run keeps: the values in its config (``held``) of the flags
    not given now (nor ``fixed`` by the inputs), so that ``--out DIR --resume`` continues
    the run in DIR as it was started, whatever the defaults are now. Nothing is kept from
    a folder that holds another experiment's run (``experiment``) or a run whose inputs
    set other values (``fixed``): the run's own check then names what differs."""
    if not held or (experiment and held.get("experiment", experiment) != experiment):
        return {}
    if any(name in held and held[name] != value for name, value in fixed.items()):
        return {}
    return {
        f.name: held[f.name]
        for f in dataclasses.fields(cls)
        if f.metadata.get("flag") and f.name in held and not hasattr(args, f.name)
        and f.name not in fixed
    }  # fmt: skip


def said_held(cls: type, kept: dict[str, Any], fixed: dict[str, Any] | None = None) -> str:
    """The options taken from a resumed run that differ from today's defaults (as the
    options store them: ``all`` as the names it stands for), as flags (``"--methods
    flow,rollout --n 32"``; an empty list as ``none``; empty when none differs)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    try:
        defaults = cls(**(fixed or {})).to_dict()
    except (TypeError, ValueError):  # defaults that need other values: as declared
        defaults = {
            name: list(d) if isinstance(d := _declared(f), tuple) else d
            for name, f in fields.items()
        }
    parts = []
    for name, value in kept.items():
        f = fields[name]
        if value == defaults.get(name):
            continue
        if f.metadata["parse"] in ("flag", "no-flag"):  # differs: the flag was given
            parts.append(f.metadata["flag"])
            continue
        if isinstance(value, list):
            shown = ",".join(map(str, value)) or "none"
        else:
            shown = "none" if value is None else str(value)
        parts.append(f"{f.metadata['flag']} {shown}")
    return " ".join(parts)


def _declared(f: dataclasses.Field[Any]) -> Any:
    """A field's declared default."""
    return f.default_factory() if callable(f.default_factory) else f.default


def resumed_options(
    cls: type, args: argparse.Namespace, fixed: dict[str, Any], experiment: str
) -> dict[str, Any]:
    """With ``--resume`` on a folder that holds a run of ``experiment``:
    :func:`held_options`, and a line on standard error naming those that differ from
    today's defaults."""
    from ..runs import RunFolder
    from .common import notice

    held = RunFolder.held_config(args.out) if getattr(args, "resume", False) else None
    kept = held_options(cls, args, held, fixed, experiment)
    said = said_held(cls, kept, fixed)
    if said:
        notice(f"resuming the run in {args.out} with its options: {said}")
    return kept
