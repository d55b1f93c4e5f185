"""Arguments shared by several sub-commands, and their conversion to API options."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from ..loading import EMBEDDED


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help=f"embedded ({', '.join(EMBEDDED)}; default smollm2), a model folder, a .gguf "
        "file or a hub id",
    )
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None, help="e.g. cpu, cuda (default: cpu)")


def add_text_arguments(p: argparse.ArgumentParser, example: bool = True) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="the text to trace")
    src.add_argument("--file", type=Path, help="read the text from a file ('-' for stdin)")
    if example:
        src.add_argument(
            "--example", action="store_true", help="use the example text shipped with the package"
        )


def read_text(args: argparse.Namespace) -> str:
    if getattr(args, "example", False):
        from importlib.resources import files

        return files("contribution_weights").joinpath("examples/example.txt").read_text()
    if args.text is not None:
        return str(args.text)
    if str(args.file) == "-":
        return sys.stdin.read()
    path = Path(args.file)
    if not path.is_file():
        raise FileNotFoundError(f"text file {path} does not exist")
    return path.read_text()


def positive_int(value: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, not {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def parse_int_list(value: str) -> list[int]:
    """``"0,5,-1"``, ranges ``"0-3"`` and negative ranges ``"-3--1"`` into ints."""
    out: list[int] = []
    for part in value.split(","):
        part = part.strip()
        if not part:
            continue
        match = _RANGE.fullmatch(part)
        if match is None:
            raise argparse.ArgumentTypeError(
                f"{part!r} is not an index or a range; write e.g. 0,5,-1 or 0-3 or -3--1"
            )
        lo, hi = int(match[1]), int(match[2] if match[2] is not None else match[1])
        if hi < lo:
            raise argparse.ArgumentTypeError(
                f"range {part!r} is empty (its end is below its start)"
            )
        out.extend(range(lo, hi + 1))
    return out


_RANGE = re.compile(r"(-?\d+)(?:-(-?\d+))?")
