"""Benchmark: cost of cw.trace against an eager forward and the naive (H, T, T, d) approach.

Run with ``make bench`` (or ``python benchmarks/bench_trace.py --out bench-out``). For each
sequence length T, in one run and on one machine, it measures on SmolLM2-135M (or
``--model gemma3-270m``):

* ``eager``: the model's eager forward with ``output_attentions=True`` (the baseline);
* ``sdpa``: the model's own sdpa forward (the floor; the only baseline that runs at long
  context, where eager attention with ``output_attentions`` cannot);
* ``contribution``: ``cw.trace`` with ``measures="contribution"``, maps in memory;
* ``default``: ``cw.trace`` with the default measures (``"all"``: every measure but
  ``distance`` and ``ihc``), maps in memory;
* ``layers3``: the default measures for three layers (first, middle, last) of the model;
* ``no-maps``: the default measures, ``maps=False`` (reductions only);
* ``stream-f16``: ``contribution`` and ``attention`` for every layer streamed to a
  temporary folder in float16 (the folder's size is reported);
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

from _timing import data_dir  # benchmarks/_timing.py, beside this script

METHODS = ["eager", "sdpa", "contribution", "default", "naive"]
ALL_METHODS = [*METHODS, "layers3", "no-maps", "stream-f16"]


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
    jsonl = data_dir() / "fineweb_edu" / "fineweb_edu_sample10BT_150docs.jsonl"
    if jsonl.exists():
        texts = [json.loads(line)["text"] for line in jsonl.read_text().splitlines()]
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


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def worker(method: str, length: int, repeats: int, threads: int, model_name: str) -> dict:
    import shutil
    import tempfile

    import torch

    import contribution_weights as cw

    if threads > 0:
        torch.set_num_threads(threads)

    model = cw.load_model(model_name)
    if method in ("eager", "naive"):
        model.model.set_attn_implementation("eager")
    elif method == "sdpa":
        model.model.set_attn_implementation("sdpa")
    ids = benchmark_ids(model, length)
    n = model.num_layers
    stream = Path(tempfile.mkdtemp(prefix="cw-bench-"))
    disk = 0

    def run_once() -> None:
        nonlocal disk
        with torch.no_grad():
            if method == "eager":
                model.model(input_ids=ids[None], output_attentions=True, use_cache=False)
            elif method == "sdpa":
                model.model(input_ids=ids[None], use_cache=False, logits_to_keep=1)
            elif method == "contribution":
                cw.trace(model, ids, measures="contribution")
            elif method == "default":
                cw.trace(model, ids)
            elif method == "layers3":
                cw.trace(model, ids, layers=[0, n // 2, n - 1])
            elif method == "no-maps":
                cw.trace(model, ids, maps=False)
            elif method == "stream-f16":
                cw.trace(
                    model,
                    ids,
                    measures=["contribution", "attention"],
                    storage_dtype="float16",
                    out=stream,
                    overwrite=True,  # each repetition replaces the last
                )
                disk = folder_bytes(stream)
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
    shutil.rmtree(stream, ignore_errors=True)
    return {
        "method": method,
        "tokens": length,
        "seconds": statistics.median(times),
        "runs": times,
        "peak_mb": (rss.peak - base) / 2**20,
        "disk_mb": disk / 2**20,
    }


def run_worker_process(
    method: str, length: int, repeats: int, mem_limit_gb: float, threads: int, model: str
) -> dict:
    cmd = [sys.executable, __file__, "--worker", method, str(length), str(repeats)]
    cmd += ["--mem-limit-gb", str(mem_limit_gb), "--threads", str(threads), "--model", model]
    env = dict(os.environ)
    if threads > 1:  # two OpenMP threads on a shared 2-core machine spin-wait without this
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
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
    floor = {r["tokens"]: r["seconds"] for r in results if r["method"] == "sdpa"}
    naive = {r["tokens"]: r["seconds"] for r in results if r["method"] == "naive"}
    lines = [
        "| T | method | wall s | × eager | × sdpa | naive ÷ this | peak MB above loaded model "
        "| disk MB |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        t, s = r["tokens"], r["seconds"]
        if s is None:
            lines.append(f"| {t} | {r['method']} | {r.get('error')} | | | | | |")
            continue
        ratio = f"{s / base[t]:.2f}" if base.get(t) else ""
        over = f"{s / floor[t]:.2f}" if floor.get(t) else ""
        speed = f"{naive[t] / s:.1f}" if naive.get(t) and r["method"] != "naive" else ""
        disk = f"{r['disk_mb']:.0f}" if r.get("disk_mb") else ""
        lines.append(
            f"| {t} | {r['method']} | {s:.3f} | {ratio} | {over} | {speed} | "
            f"{r['peak_mb']:.0f} | {disk} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=3, metavar=("METHOD", "T", "REPEATS"))
    parser.add_argument("--lengths", default="128,512,1024,2048")
    parser.add_argument(
        "--methods", default=",".join(METHODS), help=f"any of {','.join(ALL_METHODS)}"
    )
    parser.add_argument("--model", default="smollm2", help="smollm2 or gemma3-270m")
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
        result = worker(method, int(length), int(repeats), args.threads, args.model)
        print(json.dumps(result))
        return 0
    results = []
    for length in [int(x) for x in args.lengths.split(",")]:
        for method in args.methods.split(","):
            # the naive baseline is slow and its spread small against its cost: one run
            repeats = args.repeats if length <= 512 and method != "naive" else 1
            r = run_worker_process(
                method, length, repeats, args.mem_limit_gb, args.threads, args.model
            )
            results.append(r)
            shown = f"{r['seconds']:.3f} s" if r["seconds"] is not None else r["error"]
            print(f"T={length:5d} {method:17s} {shown}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    threads = args.threads or "default"
    policy = " (OMP_WAIT_POLICY=PASSIVE)" if args.threads > 1 else ""
    machine = (
        f"{platform.machine()}, {os.cpu_count()} CPUs, torch threads: {threads}{policy}, "
        f"Python {platform.python_version()}, model {args.model}"
    )
    stem = f"bench_trace-{args.model}-t{threads}"
    (args.out / f"{stem}.json").write_text(
        json.dumps({"machine": machine, "results": results}, indent=2)
    )
    table = markdown(results)
    (args.out / f"{stem}.md").write_text(f"Machine: {machine}\n\n{table}\n")
    print(f"\nMachine: {machine}\n\n{table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
