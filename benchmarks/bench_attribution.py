"""Benchmark: every attribution method against one forward of the same input.

``python benchmarks/bench_attribution.py [--lengths 128,512,2048] [--methods ...] --threads 1``

For each length T (real FineWeb-Edu text where present, else the example text) and method,
in its own process (so that peak memory is that method's alone, sampled from
/proc/self/statm above the level after the model is loaded and warmed up):

* ``eager``: one forward with the model's eager attention (attention probabilities
  materialised, as attribution tools that read them run it);
* ``sdpa``: one forward with the model's default sdpa kernel (logits of the last position);
* every registered attribution method (``cw.attribute(model, ids, methods=NAME)``),
  explaining the log-probability of the model's top prediction at the last position.

Wall time is the median of ``--repeats`` runs (one run where a method takes over
``--slow`` seconds). Ratios are against ``eager`` and ``sdpa`` at the same T, measured in
the same run. ``--skip NAME:T`` leaves a point out (its table row says so).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_trace import PeakRSS, benchmark_ids  # benchmarks/bench_trace.py, beside this

BASELINES = ["eager", "sdpa"]
METHODS = ["flow", "direct", "rollout", "alti", "input_x_gradient", "integrated_gradients",
           "feature_ablation"]  # fmt: skip


def worker(method: str, length: int, repeats: int, slow: float, threads: int, name: str) -> dict:
    import torch

    import contribution_weights as cw

    if threads > 0:
        torch.set_num_threads(threads)
    model = cw.load_model(name)
    if method == "eager":
        model.model.set_attn_implementation("eager")
    ids = benchmark_ids(model, length)

    def run_once() -> None:
        with torch.no_grad():
            if method == "eager":
                model.model(input_ids=ids[None], output_attentions=True, use_cache=False)
                return
            if method == "sdpa":
                model.model(input_ids=ids[None], use_cache=False, logits_to_keep=1)
                return
        cw.attribute(model, ids, methods=method)

    with torch.no_grad():  # warm up kernels and allocator on a short input
        model.model(input_ids=ids[None, :16], use_cache=False)
    cw.attribute(model, ids[:16], methods=method if method not in BASELINES else "flow")
    times: list[float] = []
    rss = PeakRSS()
    base = rss.current()
    with rss:
        for _ in range(repeats):
            start = time.perf_counter()
            run_once()
            times.append(time.perf_counter() - start)
            if times[-1] > slow:
                break
    return {
        "method": method,
        "tokens": length,
        "seconds": statistics.median(times),
        "runs": times,
        "peak_mb": (rss.peak - base) / 2**20,
    }


def run_worker(method: str, length: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker", method, str(length)]
    cmd += ["--repeats", str(args.repeats), "--slow", str(args.slow)]
    cmd += ["--threads", str(args.threads), "--model", args.model]
    env = dict(os.environ)
    if args.threads > 1:  # two OpenMP threads on a shared 2-core machine spin-wait without this
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode == 0 and lines:
        return dict(json.loads(lines[-1]))
    tail = (proc.stderr or "").strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
    return {"method": method, "tokens": length, "seconds": None, "error": tail[0][:200]}


def markdown(results: list[dict]) -> str:
    eager = {r["tokens"]: r["seconds"] for r in results if r["method"] == "eager"}
    sdpa = {r["tokens"]: r["seconds"] for r in results if r["method"] == "sdpa"}
    lines = [
        "| T | method | wall s | × eager forward | × sdpa forward | peak MB above loaded model |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        t, s = r["tokens"], r["seconds"]
        if s is None:
            lines.append(f"| {t} | {r['method']} | {r.get('error')} | | | |")
            continue
        e = f"{s / eager[t]:.2f}" if eager.get(t) else ""
        f = f"{s / sdpa[t]:.2f}" if sdpa.get(t) else ""
        lines.append(f"| {t} | {r['method']} | {s:.3f} | {e} | {f} | {r['peak_mb']:.0f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", nargs=2, metavar=("METHOD", "T"))
    p.add_argument("--lengths", default="128,512,2048")
    p.add_argument("--methods", default=",".join(BASELINES + METHODS))
    p.add_argument("--skip", default="", help="points left out, e.g. feature_ablation:2048")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--slow", type=float, default=30.0, help="one run above this many seconds")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    args = p.parse_args()
    if args.worker:
        method, length = args.worker
        result = worker(method, int(length), args.repeats, args.slow, args.threads, args.model)
        print(json.dumps(result))
        return 0
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    results = []
    for length in [int(x) for x in args.lengths.split(",")]:
        for method in args.methods.split(","):
            if f"{method}:{length}" in skip:
                results.append({"method": method, "tokens": length, "seconds": None,
                                "error": "not run (--skip)"})  # fmt: skip
                continue
            r = run_worker(method, length, args)
            results.append(r)
            shown = f"{r['seconds']:.3f} s" if r["seconds"] is not None else r["error"]
            print(f"T={length:5d} {method:22s} {shown}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    machine = (
        f"{platform.machine()}, {os.cpu_count()} CPUs, torch threads: {args.threads}, "
        f"Python {platform.python_version()}, model {args.model}"
    )
    stem = f"bench_attribution-{args.model}-t{args.threads}"
    (args.out / f"{stem}.json").write_text(
        json.dumps({"machine": machine, "results": results}, indent=2)
    )
    table = markdown(results)
    (args.out / f"{stem}.md").write_text(f"Machine: {machine}\n\n{table}\n")
    print(f"\nMachine: {machine}\n\n{table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
