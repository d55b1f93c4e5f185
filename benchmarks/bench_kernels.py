"""Benchmark: plain torch against compiled (torch.compile) block reductions in a trace.

``python benchmarks/bench_kernels.py [--model smollm2] [--lengths 2048,4096] [--layers 0,15,29]
[--measures all] [--repeats 3] [--profile] [--out FILE.json]``

``python benchmarks/bench_kernels.py --tables FILE.json`` writes ``FILE.md`` again from a
results file (what ``--out`` writes beside the JSON; the docs quote its tables).

For each length T, in one process and on the same input (FineWeb-Edu documents joined, cut
to T tokens), it times the median of ``--repeats`` interleaved rounds (one call of each
variant per round) of:

* ``sdpa``: the model's own forward (the floor);
* ``torch``: ``cw.trace(..., maps=False, layers=LAYERS, kernels="torch")``;
* ``compiled``: the same with ``kernels="compiled"`` (compiled before the timed rounds;
  the first compile's seconds are reported apart as ``compile_s``).

The traced layers' extra cost is ``(trace − sdpa) / len(LAYERS)`` per layer, reported
beside one sdpa layer's share (``sdpa / num_layers``) and as the whole-model ratio it
implies, ``(sdpa + num_layers · extra) / sdpa``: what tracing every layer would cost
against the model's forward. The two kernels' reductions are compared as well (largest
absolute difference of the token sums; top keys equal or not). Run with
``OMP_NUM_THREADS=1`` and nothing else on the machine.

``--block`` times instead the entropies' Σ a ln a over one synthetic block (9 heads × 111
queries × 4,096 keys, SmolLM2's shape at that length): torch's
(:func:`~contribution_weights.measures.aggregates.sum_a_log_a`, three passes) against the
same sum compiled into one fused loop, the medians of 7 calls; no model, no data.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from _timing import data_dir, interleaved_medians  # benchmarks/_timing.py, beside this script


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--lengths", default="2048,4096")
    p.add_argument("--layers", default="0,15,29", help="traced layers (default 0,15,29)")
    p.add_argument("--measures", default="all")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--note", default="", help="what else ran on the machine, for the record")
    p.add_argument("--out", type=Path, default=None, help="write the results (JSON) here")
    p.add_argument("--block", action="store_true", help="time Σ a ln a on one block only")
    p.add_argument(
        "--tables", type=Path, default=None, metavar="FILE.json",
        help="write FILE.md (the Markdown tables) from a results file, and time nothing",
    )  # fmt: skip
    p.add_argument(
        "--profile",
        action="store_true",
        help="also profile one trace of each kernel (cProfile) and record where the "
        "reduction's time goes (the 'profile' field of each row)",
    )
    args = p.parse_args()
    if args.block:
        return block()
    if args.tables is not None:
        result = json.loads(args.tables.read_text())
        args.tables.with_suffix(".md").write_text(markdown(result))
        return 0
    data_dir()  # $CW_DATA_DIR, checked

    import torch

    import contribution_weights as cw

    model = cw.load_model(args.model)
    layers = [int(x) for x in args.layers.split(",")]
    text = "\n\n".join(cw.data.load_texts("fineweb-edu", 60))
    all_ids = torch.tensor(model.tokenizer(text)["input_ids"])
    rows = []
    for t in [int(x) for x in args.lengths.split(",")]:
        if all_ids.numel() < t:
            raise SystemExit(f"the joined documents hold {all_ids.numel()} tokens, not {t}")
        ids = all_ids[:t]

        def sdpa(ids: Any = ids) -> None:
            with torch.no_grad():
                model.model(input_ids=ids[None])

        def traced(kernels: str, ids: Any = ids) -> Any:
            return cw.trace(
                model, ids, maps=False, layers=layers, measures=args.measures,
                kernels=kernels, progress=False,
            )  # fmt: skip

        start = time.perf_counter()
        compiled = traced("compiled")
        compile_s = time.perf_counter() - start
        plain = traced("torch")
        times = interleaved_medians(
            {
                "sdpa": sdpa,
                "torch": lambda: traced("torch"),
                "compiled": lambda: traced("compiled"),
            },
            args.repeats,
        )
        n = model.num_layers
        row: dict[str, Any] = {"tokens": t, **{f"{k}_s": round(v, 3) for k, v in times.items()}}
        row["compile_s"] = round(compile_s, 1)
        row["sdpa_layer_s"] = round(times["sdpa"] / n, 4)
        for kernels in ("torch", "compiled"):
            extra = (times[kernels] - times["sdpa"]) / len(layers)
            row[f"{kernels}_extra_per_layer_s"] = round(extra, 4)
            row[f"{kernels}_all_layers_over_sdpa"] = round(
                (times["sdpa"] + n * extra) / times["sdpa"], 2
            )
        row["extra_torch_over_compiled"] = round(
            row["torch_extra_per_layer_s"] / max(row["compiled_extra_per_layer_s"], 1e-9), 2
        )
        diffs, same_top = [], True
        for name, r in plain.reductions.items():
            c = compiled.reductions[name]
            diffs.append(
                float(
                    (r.token_sums - c.token_sums).abs().max()
                    / r.token_sums.abs().max().clamp_min(1e-30)
                )
            )
            if r.top_keys is not None and c.top_keys is not None:
                same_top &= bool(torch.equal(r.top_keys, c.top_keys))
        row["token_sums_max_rel_diff"] = max(diffs)
        row["top_keys_equal"] = same_top
        if args.profile:
            row["profile"] = {k: profile_parts(lambda k=k: traced(k)) for k in KERNEL_CHOICES}
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {
        "model": model.name,
        "layers": layers,
        "measures": args.measures,
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "note": args.note,
        "rows": rows,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(markdown(result))
    return 0


def markdown(result: dict[str, Any]) -> str:
    """The results as Markdown: the timings per length, then (for rows with a profile)
    where each kernel's reduction time went."""
    rows = result["rows"]
    layers = round(rows[0]["sdpa_s"] / rows[0]["sdpa_layer_s"])  # the model's layer count
    lines = [
        f"# Plain torch against compiled reductions: {result['model']}, layers "
        f"{', '.join(map(str, result['layers']))} traced, measures {result['measures']}",
        "",
        f"{result['machine']}, torch {result['torch']}, {result['threads']} thread(s), "
        f"OMP_WAIT_POLICY={result['omp_wait_policy'] or 'unset'}; {result['note']}",
        "",
        "| T | sdpa forward s | plain: extra s per traced layer | compiled: extra s per "
        f"traced layer | all {layers} layers, plain / compiled (× sdpa) | first compile s |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['tokens']:,} | {r['sdpa_s']:.2f} | {r['torch_extra_per_layer_s']:.2f} | "
            f"{r['compiled_extra_per_layer_s']:.2f} | {r['torch_all_layers_over_sdpa']:.1f} / "
            f"{r['compiled_all_layers_over_sdpa']:.1f} | {r['compile_s']:.1f} |"
        )
    for r in (r for r in rows if "profile" in r):
        plain, comp = r["profile"]["torch"], r["profile"]["compiled"]
        built = sum(v for k, v in plain.items() if " block (layer." in k)
        parts = [
            ("the sums (plain: `block_sums`; compiled: inductor's fused kernel)",
             plain.get("plain sums (kernels.block_sums)"), comp.get("compiled kernel (inductor)")),
            ("the top keys (plain: `top_indices` on the built blocks; compiled: `_top`, the "
             "candidate chunks read again through the recipes)",
             plain.get("top keys, plain (reductions.top_indices)"),
             comp.get("top keys, compiled (recorder._top)")),
            ("building the blocks summed (plain: ĉ, č, κ, vw; compiled: p, č)", built,
             comp.get("compiled pass's blocks (recorder._reduce_fused's list)")),
            ("whole `_reduce`", plain.get("reduce (recorder._reduce, per block)"),
             comp.get("reduce (recorder._reduce, per block)")),
        ]  # fmt: skip
        lines += [
            "",
            f"| part of `_reduce` ({len(result['layers'])} layers, {r['tokens']:,} tokens) "
            "| plain torch s | compiled s |",
            "| --- | ---: | ---: |",
        ]
        lines += [f"| {label} | {_s(a)} | {_s(b)} |" for label, a, b in parts]
    return "\n".join(lines) + "\n"


def _s(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds:.2f}"


KERNEL_CHOICES = ("torch", "compiled")
#: the functions whose cumulative seconds --profile records: (file name, function)
PROFILED = {
    "reduce (recorder._reduce, per block)": ("recorder.py", "_reduce"),
    "plain sums (kernels.block_sums)": ("kernels.py", "block_sums"),
    "top keys, plain (reductions.top_indices)": ("reductions.py", "top_indices"),
    "top keys, compiled (recorder._top)": ("recorder.py", "_top"),
    "compiled pass's blocks (recorder._reduce_fused's list)": ("recorder.py", "<listcomp>"),
    "contribution block (layer.contribution)": ("layer.py", "contribution"),
    "projection block (layer.projection)": ("layer.py", "projection"),
    "intra block (layer.intra)": ("layer.py", "intra"),
    "cosine block (layer.cosine)": ("layer.py", "cosine"),
    "vw block (layer.vw)": ("layer.py", "vw"),
}


def profile_parts(fn: Any) -> dict[str, float]:
    """Seconds of one call of ``fn`` under cProfile: the whole call, the functions of
    :data:`PROFILED` (cumulative) and the compiled kernels (inductor's generated
    ``kernel`` functions, their own time)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.runcall(fn)
    out = {"whole call": round(time.perf_counter() - start, 3)}
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    for label, (file, func) in PROFILED.items():
        total = sum(v[3] for (f, _, name), v in stats.items() if f.endswith(file) and name == func)
        if total:
            out[label] = round(total, 3)
    kernel = sum(v[2] for (_, _, name), v in stats.items() if name.endswith("kernel.kernel>"))
    if kernel:
        out["compiled kernel (inductor)"] = round(kernel, 3)
    return out


def block() -> int:
    """Σ a ln a over one softmax block: plain torch against one compiled loop."""
    import statistics

    import torch

    from contribution_weights.measures.aggregates import sum_a_log_a

    a = torch.softmax(torch.randn(9, 111, 4096, generator=torch.Generator().manual_seed(0)), -1)

    def fused(x: torch.Tensor) -> torch.Tensor:
        return (x * x.clamp_min(torch.finfo(x.dtype).tiny).log()).sum(-1)

    compiled = torch.compile(fused, dynamic=False)
    torch.testing.assert_close(compiled(a), sum_a_log_a(a))
    for name, fn in (("plain", sum_a_log_a), ("compiled", compiled)):
        fn(a)
        times = []
        for _ in range(7):
            start = time.perf_counter()
            fn(a)
            times.append(time.perf_counter() - start)
        print(f"{name}: {statistics.median(times) * 1e3:.1f} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
