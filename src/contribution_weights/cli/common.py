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


def model_device(args: argparse.Namespace) -> str | None:
    """``--device``, or under a data-parallel launch on GPUs this process's own GPU."""
    if args.device is not None:
        return str(args.device)
    import os

    local = os.environ.get("LOCAL_RANK")
    if local is not None and int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        import torch

        if torch.cuda.is_available():
            return f"cuda:{int(local)}"
    return None


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


def add_corpus_arguments(p: argparse.ArgumentParser) -> None:
    """Where the texts of a corpus experiment come from: --dataset | --texts | --file,
    --field, --n and --data-dir (read them with :func:`load_corpus`)."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--dataset", choices=["gsm8k", "fineweb-edu"], help="evaluation data set")
    src.add_argument("--texts", type=Path, help="a .jsonl file of texts (field: --field)")
    src.add_argument("--file", type=Path, help="a .txt file (texts separated by blank lines)")
    p.add_argument("--field", default="text", help="JSONL field holding the text (default text)")
    p.add_argument("--n", type=positive_int, default=None, help="use the first N texts")
    p.add_argument("--data-dir", type=Path, default=None, help="data folder (else $CW_DATA_DIR)")


def load_corpus(args: argparse.Namespace) -> tuple[list[str], str]:
    """The texts named by :func:`add_corpus_arguments`, and their source (for titles)."""
    from .. import data

    if args.n is not None and args.n < 1:
        raise ValueError(f"--n must be at least 1, not {args.n}")
    if args.dataset:
        return data.load_texts(args.dataset, args.n, args.data_dir), str(args.dataset)
    path = args.texts or args.file
    texts = data.read_texts(path, field=args.field)
    return (texts if args.n is None else texts[: args.n]), str(path)


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
