"""``cw faithfulness``: comprehensiveness and sufficiency of measures (paper Figure 3)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..experiments.faithfulness import DEFAULT_MEASURES, DEFAULT_RATES
from ..interventions import MODES, SCOPES, SINK_COSINE
from ..measures.registry import measure_names
from .common import (
    add_corpus_arguments,
    add_model_arguments,
    check_out_dir,
    load_corpus,
    parse_floats,
    positive_int,
)


def parse_rates(value: str) -> list[float]:
    rates = parse_floats(value)
    if any(not 0 <= r <= 1 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must lie in [0, 1], got {value!r}")
    return rates


def parse_names(value: str) -> list[str]:
    return [x.strip() for x in value.replace(" ", ",").split(",") if x.strip()]


def at_least_two(value: str) -> int:
    """An argparse type for --max-tokens: a score needs at least 2 tokens."""
    n = positive_int(value)
    if n < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2 (a token and its next), got {n}")
    return n


def add_removal_arguments(p: argparse.ArgumentParser, max_tokens_help: str) -> None:
    p.add_argument(
        "--measures",
        type=parse_names,
        default=list(DEFAULT_MEASURES),
        help=f"comma-separated measures (default {','.join(DEFAULT_MEASURES)}; "
        f"any of {', '.join(measure_names())})",
    )
    p.add_argument(
        "--rates",
        type=parse_rates,
        default=list(DEFAULT_RATES),
        help=f"removal rates p (default {','.join(map(str, DEFAULT_RATES))})",
    )
    p.add_argument("--max-tokens", type=at_least_two, default=512, help=max_tokens_help)
    p.add_argument(
        "--sink-threshold",
        type=float,
        default=SINK_COSINE,
        help=f"a token is a sink at a layer when its hidden state has cosine above this with "
        f"token 0's (default {SINK_COSINE})",
    )
    p.add_argument(
        "--no-sink-protection",
        dest="protect_sinks",
        action="store_false",
        help="let sink tokens be removed too (appendix C.3)",
    )
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
    p.add_argument("--modes", type=parse_names, default=list(MODES), help="default: both")
    p.add_argument("--scope", choices=SCOPES, default="layer", help="ranking scope")
    add_removal_arguments(
        p, "keep the first N tokens of longer texts (default 512; texts under 2 tokens are skipped)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..experiments.faithfulness import FaithfulnessOptions, faithfulness
    from ..loading import load_model

    check_out_dir(args.out)  # before the data and the model load
    texts, source = load_corpus(args)
    options = FaithfulnessOptions(
        measures=args.measures,
        rates=args.rates,
        modes=args.modes,
        protect_sinks=args.protect_sinks,
        scope=args.scope,
        max_tokens=args.max_tokens,
        sink_threshold=args.sink_threshold,
    ).check()  # bad options fail before the model loads
    model = load_model(args.model, dtype=args.dtype, device=args.device)
    result = faithfulness(
        model,
        texts,
        options=options,
        out=args.out,
        resume=args.resume,
        batch_size=args.batch_size,
        source=source,
    )
    print(result.summary.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    if result.config["skipped"]:
        print(f"skipped {result.config['skipped']} blank texts or texts under 2 tokens")
    written = "per_sequence.csv, summary.csv"
    if not result.summary.empty:
        result.plot(args.out / "faithfulness.png")
        written += ", faithfulness.png"
    print(f"wrote {args.out}/{written}")
    return 0
