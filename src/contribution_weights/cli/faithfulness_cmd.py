"""``cw faithfulness``: comprehensiveness and sufficiency of measures (paper Figure 3)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..experiments.faithfulness import FaithfulnessOptions
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
    from ..experiments.faithfulness import faithfulness
    from ..experiments.runner import processes
    from ..loading import load_model

    check_out_dir(args.out)  # before the data and the model load
    options = options_from_args(FaithfulnessOptions, args)  # bad options fail before loading
    texts, source = load_corpus(args)
    model = load_model(args.model, dtype=args.dtype, device=model_device(args))
    texts, source = fit_corpus(args, model, texts, source)
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
        result.plot(args.out / "faithfulness.png")
        written += ", faithfulness.png"
    print(f"wrote {args.out}/{written}")
    return 0
