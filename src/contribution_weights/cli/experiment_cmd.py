"""``cw <experiment>`` generated from a registered :class:`~..experiments.spec.ExperimentSpec`.

Every experiment command is the same steps: check ``--out``, build the options (bad values
fail before anything loads), read the inputs, load the model, run (resumable, data
parallel under ``accelerate launch``), print the summary and the skipped units, draw the
figure, and list the files written.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..experiments.spec import ExperimentSpec
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


def add_run_arguments(p: argparse.ArgumentParser, batch_size: bool = True) -> None:
    """--out, --resume, (--batch-size) and the model arguments of an experiment."""
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    if batch_size:
        p.add_argument(
            "--batch-size", type=positive_int, default=None, help="rows per forward (default: auto)"
        )
    add_model_arguments(p)


def print_skipped(result: object) -> None:
    skipped = getattr(result, "skipped", [])
    if skipped:
        reasons = sorted({s["reason"] for s in skipped})
        print(f"skipped {len(skipped)} units ({'; '.join(reasons)}); see run_info.json")


def register(sub: argparse._SubParsersAction, spec: ExperimentSpec) -> None:
    p = sub.add_parser(spec.name, help=spec.help)
    if spec.inputs == "corpus":
        add_corpus_arguments(p)
    add_options(p, spec.options)
    add_run_arguments(p, batch_size=spec.batch_size)
    p.set_defaults(func=lambda args: run(args, spec))


def run(args: argparse.Namespace, spec: ExperimentSpec) -> int:
    from ..data import MissingDataError
    from ..experiments.result import few_samples_on_stderr
    from ..experiments.runner import processes
    from ..loading import load_model
    from ..presentation.figures import figure_for, plot

    check_out_dir(args.out)  # before the data and the model load
    options = options_from_args(spec.options, args)  # bad options fail before loading
    texts: Any = None
    source = spec.name
    if spec.inputs == "corpus":
        try:
            texts, source = load_corpus(args)
        except MissingDataError as err:
            raise err.for_command(spec.name, "--texts FILE.jsonl or --file FILE.txt") from None
    entry = spec.entry_point()
    model = load_model(args.model, dtype=args.dtype, device=model_device(args))
    if spec.inputs == "corpus":
        texts, source = fit_corpus(args, model, texts, source)
    extra = {"batch_size": args.batch_size} if spec.batch_size else {}
    with few_samples_on_stderr(spec.name, MORE_TEXTS):
        result = entry(
            model,
            texts,
            options=options,
            out=args.out,
            resume=args.resume,
            source=source,
            **extra,
        )
    if not processes().main:
        return 0
    summary = getattr(result, "summary", None)
    if summary is not None:
        print(summary.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    print_skipped(result)
    empty = summary is not None and getattr(summary, "empty", False)
    if spec.figure and not empty and figure_for(result) is not None:
        plot(result, args.out / spec.figure)
    written = sorted(p.name for p in Path(args.out).iterdir() if p.is_file())
    print(f"wrote {args.out}/{', '.join(written)}")
    return 0
