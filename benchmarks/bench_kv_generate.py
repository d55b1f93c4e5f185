"""Benchmark: generating on compressed caches, with room reserved for the new tokens or not.

``python benchmarks/bench_kv_generate.py [--model smollm2] [--context 4096] [--rows 12]
[--tokens 20] [--repeats 3] [--out FILE]``

The RULER-like evaluation generates a short answer for many (method, ratio) rows at once:
one prefill of ``--context`` tokens (random ids), ``--rows`` copies of its cache
compressed at ratio 0.25 and stacked, then ``--tokens`` greedy tokens after a 40-token
question. Transformers' plain cache layer concatenates each new token's key and value onto
its whole cache, copying it at every step; :func:`contribution_weights.kv.cache.reserve`
(what ``CompressedCache.generate`` does) writes them into room reserved up front. Both
variants run in interleaved rounds (:func:`_timing.interleaved_medians`) and must give the
same tokens. Each timed call also compresses and stacks the rows (the same work in both
variants, so the ratio understates the gain in generation alone). Run with
``OMP_NUM_THREADS=1``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path
from typing import Any

from _timing import interleaved_medians  # benchmarks/_timing.py, beside this script


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--rows", type=int, default=12)
    p.add_argument("--tokens", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="write the results (JSON) here")
    p.add_argument("--note", default="", help="what else ran on the machine, kept in the JSON")
    args = p.parse_args()

    import torch

    import contribution_weights as cw
    from contribution_weights import kv
    from contribution_weights.kv import cache as kv_cache

    model = cw.load_model(args.model)
    torch.manual_seed(0)
    ids = torch.randint(100, 20_000, (1, args.context))
    question = torch.randint(100, 20_000, (args.rows, 40))
    pre = kv.prefill(model, ids, methods=["snapkv"])
    reserve = kv_cache.reserve
    outputs: dict[str, Any] = {}

    def generate(reserved: bool) -> None:
        kv_cache.reserve = reserve if reserved else (lambda cache, extra: None)
        try:
            rows = [kv.compress(pre, "snapkv", 0.25) for _ in range(args.rows)]
            stacked = kv_cache.stack_caches(rows)
            outputs[str(reserved)] = stacked.generate(
                model.model, question, max_new_tokens=args.tokens,
                min_new_tokens=args.tokens, do_sample=False,
            )  # fmt: skip
        finally:
            kv_cache.reserve = reserve

    times = interleaved_medians(
        {"concatenate": lambda: generate(False), "reserved": lambda: generate(True)},
        args.repeats,
    )
    same = bool(torch.equal(outputs["False"], outputs["True"]))
    result = {
        "model": model.name,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "context": args.context,
        "rows": args.rows,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "seconds": {k: round(v, 3) for k, v in times.items()},
        "speedup": round(times["concatenate"] / times["reserved"], 3),
        "same_tokens": same,
        "note": args.note,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
