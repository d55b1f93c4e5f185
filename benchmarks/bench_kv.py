"""Benchmark: the cost of scoring a prefill for KV-cache compression, against the prefill.

``python benchmarks/bench_kv.py [--model smollm2] [--contexts 512,1024,2048] [--repeats 3]``

For each context length C, in the same process and on the same input (the first FineWeb-
Edu item of C tokens, or a repeated text without the data), times the median of
``--repeats`` rounds (each round runs every variant once, so load drift hits all alike) of:

* ``prefill``: the model's own forward with a cache (its default attention, sdpa), asking
  for the last position's logits only, as :func:`contribution_weights.kv.prefill` does;
* ``capture``: the same forward on the capture path with no observer (every layer on the
  model's own kernel, as no layer is observed or changed);
* ``scored``: :func:`contribution_weights.kv.prefill` (capture + the statistics observer:
  accumulated attention, window probabilities, window |ĉ|);
* ``methods``: every registered method's scores and kept sets at ratio 0.5, from the stats;
* ``scored_triton`` (with ``--triton``): the same with ``kernels="triton"``, the every-query
  attention sums from the tiled kernels (measures/tiled.py) instead of blocks of probabilities;
* ``windowed``: :func:`contribution_weights.kv.prefill` for the methods that read only the
  observation window (no accumulated attention): the layers run on sdpa and only the
  window's queries are eager.

and reports each as a fraction of ``prefill``. Scoring overhead = (scored − prefill +
methods) / prefill. Run with ``OMP_NUM_THREADS=1`` for stable numbers.

On a GPU, ``--shape llama-8b --device cuda`` times the same on a model of Llama-3.1-8B's shape
with random weights in bfloat16 (benchmarks/bench_gpu.py builds it; nothing is downloaded)
and random token ids, synchronising the device after each call, and adds each variant's peak
memory above the loaded model and each method's own seconds (``--shape tiny --device cpu``
runs the same code on a tiny model)::

    python benchmarks/bench_kv.py --shape llama-8b --layers 8 --device cuda \
        --contexts 8192,32768 --repeats 2 --out kv-gpu.json

Every layer of that model has the same shape, so a few of its 32 layers should give about
the ratios to the prefill that all 32 would, in a fraction of the time (on an H200, 8 and 2
layers gave the same within 3% but for the capture path's, 11% apart). Peak memory is what
each call adds to what is already allocated (the model, and the statistics the timed rounds
keep).

``python benchmarks/bench_kv.py --table OUT.md RESULT.json`` writes the Markdown table of a
committed result (:func:`markdown`: a machine line, then a row per variant the result
timed and the derived observer and scoring-overhead rows, a column pair per context: median
seconds and the ratio to the sdpa prefill) and stops, running nothing::

    python benchmarks/bench_kv.py --table docs/results/bench-kv-smollm2-capture.md \\
        docs/results/bench-kv-smollm2-capture.json
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Any

from _timing import data_dir, interleaved_medians  # benchmarks/_timing.py, beside this script

_VARIANTS = {  # a result row's "<key>_s": the table's label for it, in the table's order
    "prefill": "sdpa prefill (the model's own forward)",
    "capture": "capture, no observer",
    "windowed": "`kv.prefill`, the {window} window-only methods' statistics",
    "scored": "`kv.prefill`, every method's statistics",
    "scored_triton": '`kv.prefill(..., kernels="triton")`, every method\'s statistics',
    "methods": "every method's scores and kept sets at ratio 0.5, from the statistics",
}


def _number(value: float, digits: int) -> str:
    """A number as the docs print it: ``digits`` decimals, a minus sign (−)."""
    return f"{value:.{digits}f}".replace("-", "−")


def markdown(result: dict[str, Any]) -> str:
    """A result's table: a machine line (what the result records of it), then per variant
    timed in every row its median seconds and × the sdpa prefill at each context, the
    ratios as the result stores them (``<key>_over_prefill``, else from the seconds), and
    two derived rows: the statistics observer alone (every method's ``kv.prefill`` − the
    capture with no observer) and the scoring overhead (every method's ``kv.prefill`` −
    prefill + the methods' scores)."""
    rows = result["rows"]
    machine = [
        str(result["machine"]) if "machine" in result else None,
        f"torch threads: {result['threads']}" if "threads" in result else None,
        f"torch {result['torch']}" if "torch" in result else None,
        f"transformers {result['transformers']}" if "transformers" in result else None,
        f"model {result['model']}" if "model" in result else None,
        str(result["dtype"]).removeprefix("torch.") if "dtype" in result else None,
        f"{result['layers']} layers" if "layers" in result else None,
        f"observation window {result['window']}" if "window" in result else None,
        f"medians of {result['repeats']} interleaved rounds" if "repeats" in result else None,
    ]
    header = ["case"]
    for row in rows:
        header += [f"C = {row['context']:,} s", f"C = {row['context']:,} × sdpa"]
    lines = [
        "Machine: " + ", ".join(x for x in machine if x is not None),
        "",
        "| " + " | ".join(header) + " |",
        "| --- |" + " ---: |" * (len(header) - 1),
    ]

    def add(label: str, seconds: list[float], ratios: list[float]) -> None:
        cells = [label]
        for s, r in zip(seconds, ratios, strict=True):
            cells += [_number(s, 4), _number(r, 2)]  # seconds as stored; ×: as the page
        lines.append("| " + " | ".join(cells) + " |")

    windows = {len(row["window_methods"]) for row in rows if "window_methods" in row}
    for key, label in _VARIANTS.items():
        if not all(f"{key}_s" in row for row in rows):
            continue
        if key == "windowed" and len(windows) == 1:
            label = label.format(window=windows.pop())
        elif key == "windowed":
            label = label.replace("the {window} ", "the ")
        add(
            label,
            [row[f"{key}_s"] for row in rows],
            [
                1.0
                if key == "prefill"
                else row.get(f"{key}_over_prefill", row[f"{key}_s"] / row["prefill_s"])
                for row in rows
            ],
        )
    if all(k in row for row in rows for k in ("scored_s", "capture_s", "observer_over_prefill")):
        add(
            "the statistics observer alone (every method's `kv.prefill` − capture)",
            [row["scored_s"] - row["capture_s"] for row in rows],
            [row["observer_over_prefill"] for row in rows],
        )
    if all(k in row for row in rows for k in ("scored_s", "methods_s", "scoring_overhead")):
        add(
            "scoring overhead (every method's `kv.prefill` − prefill + scores)",
            [row["scored_s"] - row["prefill_s"] + row["methods_s"] for row in rows],
            [row["scoring_overhead"] for row in rows],
        )
    return "\n".join(lines) + "\n"


def write_table(out: Path, source: Path) -> int:
    """``--table OUT.md RESULT.json``: the Markdown table of a committed result."""
    out.write_text(markdown(json.loads(source.read_text())))
    print(f"wrote {out}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--table", nargs=2, type=Path, metavar=("OUT.md", "RESULT.json"),
        help="write the Markdown table of this committed result and stop",
    )  # fmt: skip
    p.add_argument("--model", default=None)
    p.add_argument("--contexts", default="512,1024,2048")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="write results.json here")
    p.add_argument(
        "--shape",
        choices=["llama-8b", "tiny"],
        default=None,
        help="a random model of this shape and random ids instead of --model and the data",
    )
    p.add_argument("--device", default="cpu", help="with --shape: where to build it")
    p.add_argument("--dtype", default="bfloat16", help="with --shape: its dtype")
    p.add_argument("--layers", type=int, default=None, help="with --shape: this many of its layers")
    p.add_argument(
        "--triton",
        action="store_true",
        help="also time kv.prefill(..., kernels='triton') (every-query sums from the tiled "
        "kernels; Triton's interpreter on a CPU, which is slow: a GPU's row)",
    )
    args = p.parse_args()
    if args.table:
        return write_table(*args.table)
    contexts = [int(x) for x in args.contexts.split(",")]
    if args.shape is None and (args.device, args.dtype, args.layers) != ("cpu", "bfloat16", None):
        p.error("--device, --dtype and --layers go with --shape (a named model loads as usual)")
    if args.layers is not None and args.layers < 1:
        p.error(f"--layers must be at least 1, got {args.layers}")

    import torch

    import contribution_weights as cw
    from contribution_weights.capture import capturing

    if args.shape is None:
        data_dir()  # $CW_DATA_DIR, checked
        model = cw.load_model(args.model)
        try:
            text = "\n\n".join(cw.data.load_texts("fineweb-edu", 40))
        except Exception:  # no data: any long text times the same
            text = "The quick brown fox jumps over the lazy dog. " * 2000
        all_ids = torch.tensor(model.tokenizer(text)["input_ids"])
    else:
        from bench_gpu import build_model  # beside this script

        model = build_model(args.shape == "tiny", args.device, args.dtype, args.layers)
        gen = torch.Generator().manual_seed(0)
        all_ids = torch.randint(3, model.config.vocab_size, (max(contexts),), generator=gen)
    net = model.model
    cuda = model.device.type == "cuda"

    def synced(fn: Any) -> Any:
        """``fn`` that waits for the device before it returns (timings on a GPU)."""

        def call() -> Any:
            out = fn()
            if cuda:
                torch.cuda.synchronize()
            return out

        return call

    last = model.last_logits_only()  # the last position's logits, as kv.prefill asks
    rows: list[dict[str, Any]] = []

    def write(rows: list[dict[str, Any]]) -> None:
        if args.out is not None:
            args.out.write_text(json.dumps(_result(args, model, rows), indent=2))

    for c in contexts:
        ids = all_ids[None, :c].to(model.device)

        def plain(ids: Any = ids) -> None:
            with torch.no_grad():
                net(input_ids=ids, use_cache=True, **last)

        def captured(ids: Any = ids) -> None:
            with torch.no_grad(), capturing(net):
                net(input_ids=ids, use_cache=True, **last)

        def scored(ids: Any = ids) -> Any:
            return cw.kv.prefill(model, ids)

        window_only = [
            m.name for m in cw.kv.METHODS if "attn_sum" not in cw.kv.methods.method_needs(m)
        ]

        def windowed(ids: Any = ids, names: list[str] = window_only) -> Any:
            return cw.kv.prefill(model, ids, methods=names)

        pre = scored()

        def score_one(name: str, pre: Any = pre) -> Any:
            """One method's scores and kept sets at ratio 0.5, every layer, as a call."""
            spec = cw.kv.get_method(name)
            return lambda: [cw.kv.kept_positions(spec.score(s), 0.5) for s in pre.stats.values()]

        per_method = {name: score_one(name) for name in cw.kv.method_names()}

        def methods(per_method: dict[str, Any] = per_method) -> None:
            for one_method in per_method.values():
                one_method()

        variants = {
            "prefill": plain,
            "capture": captured,
            "scored": scored,
            "windowed": windowed,
            "methods": methods,
        }
        if args.triton:

            def scored_triton(ids: Any = ids) -> Any:
                return cw.kv.prefill(model, ids, kernels="triton")

            scored_triton()  # compiled here, not in the timed rounds
            variants["scored_triton"] = scored_triton
        t = interleaved_medians({k: synced(f) for k, f in variants.items()}, args.repeats)
        extra: dict[str, Any] = {}
        if args.shape is not None:
            one = {name: synced(f) for name, f in per_method.items()}
            extra["method_s"] = {
                k: round(v, 5) for k, v in interleaved_medians(one, args.repeats).items()
            }
        if cuda:
            extra["peak_mb"] = {
                k: round(_peak_mb(variants[k]), 1)
                for k in ("prefill", "scored", "windowed", "scored_triton")
                if k in variants
            }
        row = {
            "context": c,
            **{f"{k}_s": round(v, 4) for k, v in t.items()},
            "capture_over_prefill": round(t["capture"] / t["prefill"], 3),
            "scored_over_prefill": round(t["scored"] / t["prefill"], 3),
            "observer_over_prefill": round((t["scored"] - t["capture"]) / t["prefill"], 3),
            "methods_over_prefill": round(t["methods"] / t["prefill"], 3),
            "windowed_over_prefill": round(t["windowed"] / t["prefill"], 3),
            **(
                {"scored_triton_over_prefill": round(t["scored_triton"] / t["prefill"], 3)}
                if "scored_triton" in t
                else {}
            ),
            "window_methods": window_only,
            "scoring_overhead": round(
                (t["scored"] - t["prefill"] + t["methods"]) / t["prefill"], 3
            ),
            **extra,
        }
        rows.append(row)
        print(json.dumps(row))
        write(rows)  # after each context: a time limit at the next keeps this one
    return 0


def _result(args: argparse.Namespace, model: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
    import torch
    import transformers

    import contribution_weights as cw

    cuda = model.device.type == "cuda"
    return {
        "model": model.name,
        "dtype": str(model.model.dtype),
        "threads": torch.get_num_threads(),
        "machine": torch.cuda.get_device_name()
        if cuda
        else (platform.processor() or platform.machine()),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "repeats": args.repeats,
        "layers": model.num_layers,
        "window": cw.kv.methods.WINDOW,
        "rows": rows,
    }


def _peak_mb(fn: Any) -> float:
    """Peak CUDA memory of one call of ``fn`` above what was allocated before it, in MiB."""
    import gc

    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


if __name__ == "__main__":
    raise SystemExit(main())
