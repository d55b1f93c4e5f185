"""``cw downstream``: task accuracy under sufficiency removal (paper Figure 4)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..data import TASKS
from ..experiments.options import DownstreamOptions
from .common import check_out_dir, model_device, positive_int
from .experiment_cmd import add_run_arguments, print_skipped
from .options import add_options, options_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "downstream",
        help="accuracy on MMLU/WinoGrande/BoolQ when only the top prompt tokens of each "
        "measure are kept (sufficiency)",
    )
    p.add_argument("--task", choices=TASKS, required=True)
    p.add_argument("--n", type=positive_int, default=None, help="use the first N items")
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--data-dir", type=Path, default=None, help="data folder (else $CW_DATA_DIR, else the hub)"
    )
    src.add_argument(
        "--items",
        type=Path,
        default=None,
        metavar="FILE.jsonl",
        help="your own items instead of the task's data, one JSON object per line with the "
        "task's fields: mmlu: question, choices (a list of 4), answer (0-3), subject "
        "(optional); winogrande: sentence (one _ blank), option1, option2, answer (1 or 2); "
        "boolq: question, passage, label (true/false); any task: prompt, options (a list), "
        "answer (0-based index of the right option)",
    )
    add_options(p, DownstreamOptions)
    add_run_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..data import MissingDataError, load_task, read_items
    from ..experiments.downstream import downstream
    from ..experiments.runner import processes
    from ..loading import load_model
    from ..presentation.figures import plot

    check_out_dir(args.out)  # before the data and the model load
    options = options_from_args(DownstreamOptions, args)  # bad options fail before loading
    if args.items is not None:
        items = read_items(args.items, args.task, args.n)
    else:
        try:
            items = load_task(args.task, args.n, args.data_dir)
        except MissingDataError as err:
            own = "--items FILE.jsonl (one item per line; cw downstream --help lists the fields)"
            raise err.for_command("downstream", own) from None
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
        plot(result, args.out / "downstream.png")
        written += ", downstream.png"
    print(f"wrote {args.out}/{written}")
    return 0
