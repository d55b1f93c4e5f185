"""``cw downstream``: task accuracy under sufficiency removal (paper Figure 4)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..data import TASKS
from .common import check_out_dir, positive_int
from .faithfulness_cmd import add_removal_arguments


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "downstream",
        help="accuracy on MMLU/WinoGrande/BoolQ when only the top prompt tokens of each "
        "measure are kept (sufficiency)",
    )
    p.add_argument("--task", choices=TASKS, required=True)
    p.add_argument("--n", type=positive_int, default=None, help="use the first N items")
    p.add_argument("--data-dir", type=Path, default=None, help="data folder (else $CW_DATA_DIR)")
    add_removal_arguments(
        p, "skip items whose prompt plus longest option exceed N tokens (default 512)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..data import load_task
    from ..experiments.downstream import downstream
    from ..loading import load_model

    check_out_dir(args.out)  # before the data and the model load
    items = load_task(args.task, args.n, args.data_dir)
    model = load_model(args.model, dtype=args.dtype, device=args.device)
    result = downstream(
        model,
        items,
        task=args.task,
        measures=args.measures,
        rates=args.rates,
        protect_sinks=args.protect_sinks,
        sink_threshold=args.sink_threshold,
        max_tokens=args.max_tokens,
        out=args.out,
        resume=args.resume,
        batch_size=args.batch_size,
    )
    print(result.summary.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    if result.config["skipped"]:
        print(f"skipped {result.config['skipped']} items longer than --max-tokens")
    written = "per_item.csv, summary.csv, run_info.json"
    if not result.summary.empty:
        result.plot(args.out / "downstream.png")
        written += ", downstream.png"
    print(f"wrote {args.out}/{written}")
    return 0
