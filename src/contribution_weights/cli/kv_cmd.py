"""``cw kv-eval``: KV-cache compression by contribution against the usual methods."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..data import TEXT_DATASETS
from ..defaults import KV_TASKS as TASKS
from ..experiments.options import KVEvalOptions
from .common import add_model_arguments, check_out_dir, model_device
from .options import add_options, options_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "kv-eval",
        help="compress the KV cache after a prefill by each method and ratio; NLL of the next "
        "128 tokens (lm) or passkey accuracy",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--dataset", choices=TEXT_DATASETS, help="LM data set")
    src.add_argument("--texts", type=Path, help="a .jsonl file of texts (field: --field) for LM")
    src.add_argument("--task", choices=TASKS, help="lm or passkey (passkey needs no data)")
    p.add_argument("--field", default="text", help="JSONL field holding the text (default text)")
    p.add_argument("--data-dir", type=Path, default=None, help="data folder (else $CW_DATA_DIR)")
    add_options(p, KVEvalOptions)
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    add_model_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .. import data
    from ..experiments.kv_eval import METRIC, kv_eval
    from ..experiments.result import few_samples_on_stderr
    from ..experiments.runner import processes
    from ..loading import load_model
    from ..presentation.figures import plot

    check_out_dir(args.out)  # before the data and the model load
    task = args.task or "lm"
    texts, source = None, task
    if task == "lm":
        if args.dataset:
            try:
                texts, source = data.load_texts(args.dataset, None, args.data_dir), args.dataset
            except data.MissingDataError as err:
                own = "--texts FILE.jsonl (or --task passkey, which needs no data)"
                raise err.for_command("kv-eval", own) from None
        elif args.texts:
            texts, source = data.read_texts(args.texts, field=args.field), str(args.texts)
        else:
            raise ValueError("--task lm needs texts: use --dataset NAME or --texts FILE.jsonl")
    options = options_from_args(KVEvalOptions, args, task=task)  # fail before the model loads
    model = load_model(args.model, dtype=args.dtype, device=model_device(args))
    more = "--n 2 or more" + (
        f"; the lm task makes an item of every {options.context_tokens + 129} tokens of "
        "consecutive texts, so give texts enough for 2"
        if task == "lm"
        else ""
    )
    with few_samples_on_stderr("kv-eval", more):
        result = kv_eval(
            model, texts, options=options, out=args.out, resume=args.resume, source=source
        )
    if not processes().main:
        return 0
    print(result.summary.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    n_done = int(result.summary["n"].max()) if not result.summary.empty else 0
    if task == "lm" and n_done < options.n:
        print(
            f"only {n_done} of {options.n} items: the texts ran out (each needs "
            f"{options.context_tokens + 129} tokens)"
        )
    if not result.summary.empty:
        plot(result, args.out / f"kv-{METRIC[task]}.png")
    written = sorted(p.name for p in Path(args.out).iterdir() if p.is_file())
    print(f"wrote {args.out}/{', '.join(written)}")
    return 0
