"""Benchmark: cost of cw.trace against an eager forward and the naive (H, T, T, d) approach.

Run with ``make bench`` (or ``python benchmarks/bench_trace.py --out bench-out``). For each
sequence length T, in one run and on one machine, it measures on SmolLM2-135M:

* ``eager``: the model's eager forward with ``output_attentions=True`` (the baseline);
* ``contribution``: ``cw.trace`` with ``measures="contribution"``;
* ``all-but-distance``: ``cw.trace`` with every measure except ``distance``;
* ``naive``: the approach of existing tools (LLM-transparency-tool, ALTI): eager forward
  with hooks, then per layer the full ``(H, T, T, d)`` tensor of α_ij ṽ_j^(h), from which
  ĉ is read.

Each (method, T) runs in its own process, so that peak memory is that method's alone
(sampled from /proc/self/statm every 2 ms, above the level after the model is loaded and
warmed up) and an out-of-memory failure is contained (the process's address space is
capped at --mem-limit-gb). Wall time is the median of --repeats runs (one run for the
naive baseline and for T > 512). Ratios are against
``eager`` at the same T, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

METHODS = ["eager", "contribution", "all-but-distance", "naive"]
SHARED_TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "fineweb_edu"


class PeakRSS:
    """Samples resident memory in a thread; ``peak`` is the maximum seen (bytes)."""

    def __init__(self) -> None:
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.peak = self.current()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def current(self) -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * self.page

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.current())
            time.sleep(0.002)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.current())


def benchmark_ids(model, length: int):
    """``length`` token ids of real text (FineWeb-Edu sample when present, else the example)."""
    import torch

    texts: list[str] = []
    jsonl = SHARED_TEXT / "fineweb_edu_sample10BT_150docs.jsonl"
    if jsonl.exists():
        texts = [json.loads(line)["text"] for line in jsonl.read_text().splitlines()[:40]]
    else:
        from importlib.resources import files

        texts = [files("contribution_weights").joinpath("examples/example.txt").read_text()] * 200
    ids = model.tokenizer("\n\n".join(texts))["input_ids"][:length]
    if len(ids) < length:
        raise SystemExit(f"not enough text for {length} tokens")
    return torch.tensor(ids)


def naive_contributions(model, ids):
    """ĉ for every layer by materialising α_ij ṽ_j^(h) as an (H, T, T, d) tensor per layer."""
    import torch

    hf = model.model
    spec = model.family
    layers = spec.decoder_layers(hf)
    values: dict[int, torch.Tensor] = {}
    handles = []
    for idx, layer in enumerate(layers):
        attn = layer.self_attn

        def hook(_mod, _inp, out, idx=idx):
            values[idx] = out.detach()

        handles.append(attn.v_proj.register_forward_hook(hook))
    try:
        out = hf(input_ids=ids[None], output_attentions=True, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    result = []
    n_heads = model.num_heads
    for idx, layer in enumerate(layers):
        alpha = out.attentions[idx][0]  # (H, T, T)
        weight, bias = spec.output_weight(layer.self_attn)
        t = alpha.shape[-1]
        v = values[idx][0].reshape(t, -1, weight.shape[1] // n_heads).transpose(0, 1)  # (G, T, dh)
        v = v.repeat_interleave(n_heads // v.shape[0], dim=0)  # (H, T, dh)
        w_o = weight.reshape(weight.shape[0], n_heads, -1).permute(1, 0, 2)  # (H, d, dh)
        projected = torch.einsum("htd,hed->hte", v, w_o)  # (H, T, d)
        weighted = alpha[..., None] * projected[:, None]  # (H, T, T, d): the naive tensor
        o = weighted.sum(dim=(0, 2))
        if bias is not None:
            o = o + bias
        c = (weighted * o[None, :, None, :]).sum(-1) / (o * o).sum(-1)[None, :, None]
        result.append(c)
        del weighted
    return result


def worker(method: str, length: int, repeats: int, threads: int) -> dict:
    import torch

    import contribution_weights as cw

    if threads > 0:
        torch.set_num_threads(threads)

    model = cw.load_model()
    if method in ("eager", "naive"):
        model.model.set_attn_implementation("eager")
    ids = benchmark_ids(model, length)
    all_but_distance = [m for m in cw.measure_names() if m not in ("distance", "ihc")]

    def run_once() -> None:
        with torch.no_grad():
            if method == "eager":
                model.model(input_ids=ids[None], output_attentions=True, use_cache=False)
            elif method == "contribution":
                cw.trace(model, ids, measures="contribution")
            elif method == "all-but-distance":
                cw.trace(model, ids, measures=all_but_distance)
            elif method == "naive":
                naive_contributions(model, ids)
            else:
                raise ValueError(method)

    with torch.no_grad():  # warm up kernels and allocator on a short input
        model.model(input_ids=ids[None, :16], use_cache=False)
    times = []
    rss = PeakRSS()
    base = rss.current()
    with rss:
        for _ in range(repeats):
            start = time.perf_counter()
            run_once()
            times.append(time.perf_counter() - start)
    return {
        "method": method,
        "tokens": length,
        "seconds": statistics.median(times),
        "runs": times,
        "peak_mb": (rss.peak - base) / 2**20,
    }


def run_worker_process(
    method: str, length: int, repeats: int, mem_limit_gb: float, threads: int
) -> dict:
    cmd = [sys.executable, __file__, "--worker", method, str(length), str(repeats)]
    cmd += ["--mem-limit-gb", str(mem_limit_gb), "--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = (proc.stderr or "").strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
    oom = "memory" in tail[0].lower() or "alloc" in tail[0].lower() or proc.returncode < 0
    return {
        "method": method,
        "tokens": length,
        "seconds": None,
        "peak_mb": None,
        "error": "out of memory" if oom else tail[0][:200],
    }


def markdown(results: list[dict]) -> str:
    base = {r["tokens"]: r["seconds"] for r in results if r["method"] == "eager"}
    naive = {r["tokens"]: r["seconds"] for r in results if r["method"] == "naive"}
    lines = [
        "| T | method | wall s | × eager | naive ÷ this | peak MB above loaded model |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        t, s = r["tokens"], r["seconds"]
        if s is None:
            lines.append(f"| {t} | {r['method']} | {r.get('error')} | | | |")
            continue
        ratio = f"{s / base[t]:.2f}" if base.get(t) else ""
        speed = f"{naive[t] / s:.1f}" if naive.get(t) and r["method"] != "naive" else ""
        lines.append(f"| {t} | {r['method']} | {s:.3f} | {ratio} | {speed} | {r['peak_mb']:.0f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=3, metavar=("METHOD", "T", "REPEATS"))
    parser.add_argument("--lengths", default="128,512,1024,2048")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--repeats", type=int, default=3, help="runs per point at T <= 512")
    parser.add_argument("--mem-limit-gb", type=float, default=20.0)
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads per run (0: torch's default)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    args = parser.parse_args()
    if args.worker:
        import resource

        limit = int(args.mem_limit_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        method, length, repeats = args.worker
        print(json.dumps(worker(method, int(length), int(repeats), args.threads)))
        return 0
    results = []
    for length in [int(x) for x in args.lengths.split(",")]:
        for method in args.methods.split(","):
            # the naive baseline is slow and its spread small against its cost: one run
            repeats = args.repeats if length <= 512 and method != "naive" else 1
            r = run_worker_process(method, length, repeats, args.mem_limit_gb, args.threads)
            results.append(r)
            shown = f"{r['seconds']:.3f} s" if r["seconds"] is not None else r["error"]
            print(f"T={length:5d} {method:17s} {shown}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    threads = args.threads or "default"
    machine = (
        f"{platform.machine()}, {os.cpu_count()} CPUs, torch threads: {threads}, "
        f"Python {platform.python_version()}"
    )
    (args.out / "bench_trace.json").write_text(
        json.dumps({"machine": machine, "results": results}, indent=2)
    )
    table = markdown(results)
    (args.out / "bench_trace.md").write_text(f"Machine: {machine}\n\n{table}\n")
    print(f"\nMachine: {machine}\n\n{table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
