"""Benchmark: faithfulness throughput, batched configurations against one at a time.

``python benchmarks/bench_faithfulness.py [--n 2] [--max-tokens 64] [--out DIR]``

On SmolLM2-135M and the first ``--n`` GSM8K texts (from ``$CW_DATA_DIR`` or
``../shared/data``), runs :func:`contribution_weights.faithfulness` twice in the same
process: all (measure, mode, rate) configurations of a sequence as one batched forward
(``batch_size=None``, chunked automatically), then one configuration per forward
(``batch_size=1``). Reports sequences per minute for each, their ratio, and the largest
difference between the two runs' ΔNLL (they must agree to float rounding). Each timing
is the median of ``--repeats`` runs after a warm-up sequence. Small by default so that
it finishes in a few minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2, help="GSM8K texts (default 2)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--measures", default="attention,vw,vw_on,ihc")
    p.add_argument("--rates", default="0.1,0.3,0.5")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--model", default=None)
    p.add_argument("--out", type=Path, default=None, help="write results.json here")
    args = p.parse_args()
    os.environ.setdefault("CW_DATA_DIR", str(SHARED))

    import torch

    import contribution_weights as cw

    model = cw.load_model(args.model)
    texts = cw.data.load_texts("gsm8k", args.n)
    kw = dict(
        measures=args.measures.split(","),
        rates=[float(r) for r in args.rates.split(",")],
        max_tokens=args.max_tokens,
        progress=False,
    )
    cw.faithfulness(model, texts[:1], **kw)  # warm-up
    results = {}
    frames = {}
    for label, bs in (("batched", None), ("one_at_a_time", 1)):
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            res = cw.faithfulness(model, texts, batch_size=bs, **kw)
            times.append(time.perf_counter() - start)
        frames[label] = res.per_sequence
        sec = statistics.median(times)
        results[label] = {
            "seconds": round(sec, 2),
            "sequences_per_minute": round(60 * len(texts) / sec, 3),
        }
    diff = (frames["batched"].delta_nll - frames["one_at_a_time"].delta_nll).abs().max()
    configs = len(frames["batched"]) // len(texts)
    report = {
        "model": model.name,
        "texts": f"first {len(texts)} GSM8K test texts, truncated to {args.max_tokens} tokens",
        "configurations_per_sequence": configs,
        "rows_per_forward_batched": configs + 1,
        **results,
        "speedup_batched": round(
            results["one_at_a_time"]["seconds"] / results["batched"]["seconds"], 3
        ),
        "max_abs_delta_nll_difference": float(diff),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": platform.platform(),
        "load_average_at_end": os.getloadavg(),
    }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
