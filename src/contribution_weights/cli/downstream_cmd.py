"""``cw downstream``: task accuracy under sufficiency removal (paper Figure 4)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..data import TASKS
from ..experiments.downstream import DownstreamOptions
from .common import check_out_dir, model_device, positive_int
from .faithfulness_cmd import add_run_arguments, print_skipped
from .options import add_options, options_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "downstream",
        help="accuracy on MMLU/WinoGrande/BoolQ when only the top prompt tokens of each "
        "measure are kept (sufficiency)",
    )
    p.add_argument("--task", choices=TASKS, required=True)
    p.add_argument("--n", type=positive_int, default=None, help="use the first N items")
    p.add_argument("--data-dir", type=Path, default=None, help="data folder (else $CW_DATA_DIR)")
    add_options(p, DownstreamOptions)
    add_run_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..data import load_task
    from ..experiments.downstream import downstream
    from ..experiments.runner import processes
    from ..loading import load_model

    check_out_dir(args.out)  # before the data and the model load
    options = options_from_args(DownstreamOptions, args)  # bad options fail before loading
    items = load_task(args.task, args.n, args.data_dir)
    model = load_model(args.model, dtype=args.dtype, device=model_device(args))
    result = downstream(
        model,
        items,
        task=args.task,
        options=options,
        out=args.out,
        resume=args.resume,
        batch_size=args.batch_size,
    )
    if not processes().main:
        return 0
    print(result.summary.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    print_skipped(result)
    written = "config.json, per_item.csv, summary.csv, run_info.json"
    if not result.summary.empty:
        result.plot(args.out / "downstream.png")
        written += ", downstream.png"
    print(f"wrote {args.out}/{written}")
    return 0
