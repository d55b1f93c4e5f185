"""Benchmark: the cost of scoring a prefill for KV-cache compression, against the prefill.

``python benchmarks/bench_kv.py [--model smollm2] [--contexts 512,1024,2048] [--repeats 3]``

For each context length C, in the same process and on the same input (the first FineWeb-
Edu item of C tokens, or a repeated text without the data), times the median of
``--repeats`` rounds (each round runs every variant once, so load drift hits all alike) of:

* ``prefill``: the model's own forward with a cache (its default attention, sdpa);
* ``capture``: the same forward on the capture path with no observer (eager recomputed);
* ``scored``: :func:`contribution_weights.kv.prefill` (capture + the statistics observer:
  accumulated attention, window probabilities, window |ĉ|);
* ``methods``: every registered method's scores and kept sets at ratio 0.5, from the stats;
* ``windowed``: :func:`contribution_weights.kv.prefill` for the methods that read only the
  observation window (no accumulated attention): the layers run on sdpa and only the
  window's queries are eager.

and reports each as a fraction of ``prefill``. Scoring overhead = (scored − prefill +
methods) / prefill. Run with ``OMP_NUM_THREADS=1`` for stable numbers.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Any

from _timing import data_dir, interleaved_medians  # benchmarks/_timing.py, beside this script


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--contexts", default="512,1024,2048")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="write results.json here")
    args = p.parse_args()
    data_dir()  # $CW_DATA_DIR, checked

    import torch

    import contribution_weights as cw
    from contribution_weights.capture import capturing

    model = cw.load_model(args.model)
    net = model.model
    try:
        text = "\n\n".join(cw.data.load_texts("fineweb-edu", 40))
    except Exception:  # no data: any long text times the same
        text = "The quick brown fox jumps over the lazy dog. " * 2000
    all_ids = torch.tensor(model.tokenizer(text)["input_ids"])
    rows = []
    for c in [int(x) for x in args.contexts.split(",")]:
        ids = all_ids[None, :c]

        def plain(ids: Any = ids) -> None:
            with torch.no_grad():
                net(input_ids=ids, use_cache=True)

        def captured(ids: Any = ids) -> None:
            with torch.no_grad(), capturing(net):
                net(input_ids=ids, use_cache=True)

        def scored(ids: Any = ids) -> Any:
            return cw.kv.prefill(model, ids)

        window_only = [
            m.name for m in cw.kv.METHODS if "attn_sum" not in cw.kv.methods.method_needs(m)
        ]

        def windowed(ids: Any = ids, names: list[str] = window_only) -> Any:
            return cw.kv.prefill(model, ids, methods=names)

        pre = scored()

        def methods(pre: Any = pre) -> None:
            for name in cw.kv.method_names():
                spec = cw.kv.get_method(name)
                for stats in pre.stats.values():
                    cw.kv.kept_positions(spec.score(stats), 0.5)

        t = interleaved_medians(
            {
                "prefill": plain,
                "capture": captured,
                "scored": scored,
                "windowed": windowed,
                "methods": methods,
            },
            args.repeats,
        )
        row = {
            "context": c,
            **{f"{k}_s": round(v, 4) for k, v in t.items()},
            "capture_over_prefill": round(t["capture"] / t["prefill"], 3),
            "scored_over_prefill": round(t["scored"] / t["prefill"], 3),
            "observer_over_prefill": round((t["scored"] - t["capture"]) / t["prefill"], 3),
            "methods_over_prefill": round(t["methods"] / t["prefill"], 3),
            "windowed_over_prefill": round(t["windowed"] / t["prefill"], 3),
            "window_methods": window_only,
            "scoring_overhead": round(
                (t["scored"] - t["prefill"] + t["methods"]) / t["prefill"], 3
            ),
        }
        rows.append(row)
        print(json.dumps(row))
    result = {
        "model": model.name,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "rows": rows,
    }
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
