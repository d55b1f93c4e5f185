"""``cw kv-eval``: KV-cache compression by contribution against the usual methods."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..defaults import KV_RATIOS as DEFAULT_RATIOS
from ..defaults import KV_TASKS as TASKS
from .common import (
    add_model_arguments,
    check_out_dir,
    model_device,
    parse_floats,
    positive_int,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "kv-eval",
        help="compress the KV cache after a prefill by each method and ratio; NLL of the next "
        "128 tokens (lm) or passkey accuracy",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--dataset", choices=["gsm8k", "fineweb-edu"], help="LM data set")
    src.add_argument("--texts", type=Path, help="a .jsonl file of texts (field: --field) for LM")
    src.add_argument("--task", choices=TASKS, help="lm or passkey (passkey needs no data)")
    p.add_argument("--field", default="text", help="JSONL field holding the text (default text)")
    p.add_argument("--data-dir", type=Path, default=None, help="data folder (else $CW_DATA_DIR)")
    p.add_argument("--n", type=positive_int, default=32, help="items per cell (default 32)")
    p.add_argument(
        "--methods",
        default="all",
        help="comma-separated methods (default all; docs/kv-cache.md describes them, and an "
        "unknown name is answered with the list)",
    )
    p.add_argument(
        "--ratios",
        type=parse_floats,
        default=list(DEFAULT_RATIOS),
        help="compression ratios in [0, 1): the fraction of entries evicted; 0 = none "
        f"(default {','.join(map(str, DEFAULT_RATIOS))})",
    )
    p.add_argument(
        "--context-tokens",
        type=positive_int,
        default=512,
        help="C: tokens prefilled and compressed (default 512)",
    )
    p.add_argument("--seed", type=int, default=0, help="passkey items and random scores")
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    add_model_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .. import data
    from ..experiments.kv_eval import METRIC, KVEvalOptions, kv_eval
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
    options = KVEvalOptions(
        task=task,
        methods=args.methods,
        ratios=args.ratios,
        context_tokens=args.context_tokens,
        n=args.n,
        seed=args.seed,
    ).check()  # bad options fail before the model loads
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
    written = "config.json, per_item.csv, summary.csv, summary_paired.csv, run_info.json"
    if task == "passkey":
        written += ", summary_depth.csv"
    if not result.summary.empty:
        plot(result, args.out / f"kv-{METRIC[task]}.png")
        written += f", kv-{METRIC[task]}.png"
    print(f"wrote {args.out}/{written}")
    return 0
