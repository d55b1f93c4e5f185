"""``cw faithfulness``: comprehensiveness and sufficiency of measures (paper Figure 3)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..experiments.options import FaithfulnessOptions
from .common import (
    add_corpus_arguments,
    add_model_arguments,
    check_out_dir,
    fit_corpus,
    load_corpus,
    model_device,
    positive_int,
)
from .options import add_options, options_from_args

#: how to give a corpus experiment more than one text (the hint after a warning)
MORE_TEXTS = (
    "--dataset with --n 2 or more, or a --texts/--file holding 2 or more texts; a .txt "
    "file holds one text per block of lines separated by a blank line"
)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """--out, --resume, --batch-size and the model arguments of a removal experiment."""
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument(
        "--batch-size", type=positive_int, default=None, help="rows per forward (default: auto)"
    )
    add_model_arguments(p)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "faithfulness",
        help="comprehensiveness/sufficiency: ΔPPL when the top/bottom tokens of each measure "
        "are removed",
    )
    add_corpus_arguments(p)
    add_options(p, FaithfulnessOptions)
    add_run_arguments(p)
    p.set_defaults(func=run)


def print_skipped(result: object) -> None:
    skipped = getattr(result, "skipped", [])
    if skipped:
        reasons = sorted({s["reason"] for s in skipped})
        print(f"skipped {len(skipped)} units ({'; '.join(reasons)}); see run_info.json")


def run(args: argparse.Namespace) -> int:
    from ..data import MissingDataError
    from ..experiments.faithfulness import faithfulness
    from ..experiments.result import few_samples_on_stderr
    from ..experiments.runner import processes
    from ..loading import load_model
    from ..presentation.figures import plot

    check_out_dir(args.out)  # before the data and the model load
    options = options_from_args(FaithfulnessOptions, args)  # bad options fail before loading
    try:
        texts, source = load_corpus(args)
    except MissingDataError as err:
        raise err.for_command("faithfulness", "--texts FILE.jsonl or --file FILE.txt") from None
    model = load_model(args.model, dtype=args.dtype, device=model_device(args))
    texts, source = fit_corpus(args, model, texts, source)
    with few_samples_on_stderr("faithfulness", MORE_TEXTS):
        result = faithfulness(
            model,
            texts,
            options=options,
            out=args.out,
            resume=args.resume,
            batch_size=args.batch_size,
            source=source,
        )
    if not processes().main:
        return 0
    print(result.summary.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    print_skipped(result)
    written = "config.json, per_sequence.csv, summary.csv, run_info.json"
    if not result.summary.empty:
        plot(result, args.out / "faithfulness.png")
        written += ", faithfulness.png"
    print(f"wrote {args.out}/{written}")
    return 0
