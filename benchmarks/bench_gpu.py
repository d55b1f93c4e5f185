"""Benchmark: traces of an 8B-shaped model at long context, on a GPU (or tiny, on a CPU).

The model has Llama-3.1-8B's shape (32 layers, 32 heads, 8 KV heads, d = 4096, MLP 14,336,
vocabulary 128,256) with random weights, built in bfloat16 directly on the device: nothing
is downloaded, and random weights cost what real ones do. For each length it measures, in
one run:

* ``sdpa``: the model's own sdpa forward (the floor);
* ``no-maps``: ``cw.trace(..., maps=False, kernels="torch")`` with the default measures
  (reductions only, plain torch);
* ``no-maps-compiled``: the same with ``kernels="compiled"`` (the reductions fused by
  ``torch.compile``, Triton on a GPU; compiled during the warm-up run, not timed). On CPUs
  this measured slower than plain torch (benchmarks/bench_kernels.py), so ``kernels="auto"``
  does not compile; on an H200 (2 layers, 8,192 tokens, 2026-12-04) it was no faster either
  (10.78 s against plain torch's 10.36 s, one run each);
* ``no-maps-triton``: the same with ``kernels="triton"`` (each traced layer reduced whole
  by the tiled kernels of ``measures/tiled.py``: no map, no block of probabilities; Triton
  compiles them in the warm-up run). First measured on an H200 on 2026-12-04
  (docs/long-contexts.md);
* ``stream``: ``cw.trace(..., measures="contribution", out=DIR)``, every layer's map
  streamed to a temporary folder in bfloat16 (its size is reported);
* ``attribute-METHOD`` (``attribute-direct``, ``attribute-attnlrp``, any method of
  ``cw attribute``): ``cw.attribute(model, ids, methods=METHOD)``, the log-probability of
  the top prediction at the last position explained; against ``sdpa``, what one
  attribution costs at the 8B shape.

Wall time is one run after a warm-up on the same input (so each row runs twice: budget
twice its time); peak memory is the accelerator's
peak allocation above the loaded model (CUDA) or the peak resident memory above it (CPU).
``--layers N`` keeps N of the 32 layers (all have the same shape). On a CPU, use
``--tiny`` (a 2-layer model of the same family with small sizes; the test suite runs it so).

    python benchmarks/bench_gpu.py --device cuda --lengths 2048,8192 --out bench-out
    python benchmarks/bench_gpu.py --tiny --device cpu --lengths 64 --methods sdpa,no-maps,stream

``--profile`` also runs each row once under ``torch.profiler`` (after the warm-up, before
the timed run, which it does not touch) and writes the operators' table, heaviest self time
on the device first, to ``OUT/profile-METHOD-T.txt``: where a trace's time goes. Profile
the tiled or compiled rows: the plain ``no-maps`` row's thousands of small operators make
its profiled run very slow (it did not finish within 130 s for 2 layers at 8,192 tokens on
an H200, where its timed run takes 10 s).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

LLAMA_8B = dict(
    vocab_size=128_256,
    hidden_size=4096,
    intermediate_size=14_336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131_072,
    rope_theta=500_000.0,
    rms_norm_eps=1e-5,
)
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)


class _Ids:
    """A stand-in tokenizer: the benchmark feeds token ids; tokens print as their ids."""

    def decode(self, ids: list[int]) -> str:
        return f"<{ids[0]}>"


def build_model(tiny: bool, device: str, dtype: str, layers: int | None = None) -> Any:
    """The 8B-shaped model (or the tiny one), with ``layers`` of its layers if given."""
    shape = dict(TINY if tiny else LLAMA_8B)
    total = shape["num_hidden_layers"]
    if layers is not None and not 1 <= layers <= total:
        raise SystemExit(f"--layers must be between 1 and {total}, got {layers}")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import contribution_weights as cw

    if layers is not None:
        shape["num_hidden_layers"] = layers
    config = LlamaConfig(**shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, torch_dtype=getattr(torch, dtype))
    model.eval()
    name = "llama-tiny" if tiny else "llama-3.1-8b-shaped (random weights)"
    if layers is not None:
        name += f", {layers} of its {total} layers"
    return cw.LoadedModel(model=model, tokenizer=_Ids(), name=name)


class Peak:
    """Peak memory above the level at entry: CUDA allocations, or resident memory (CPU)."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.peak = 0

    def _rss(self) -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self) -> Peak:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = self._rss()
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss() - self.base)
            time.sleep(0.002)

    def __exit__(self, *exc: object) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, self._rss() - self.base)


#: the reductions-only rows and the kernels each traces with
KERNELS_OF = {"no-maps": "torch", "no-maps-compiled": "compiled", "no-maps-triton": "triton"}


def run(model: Any, method: str, ids: Any, folder: Path, profile: Path | None = None) -> dict:
    """One timed run of ``method``; with ``profile``, the run is also profiled (not timed)
    and the operators' table, heaviest self time on the device first, written there."""
    import torch

    import contribution_weights as cw

    def once() -> None:
        if method.startswith("attribute-"):  # gradient methods need autograd
            cw.attribute(model, ids, methods=method.removeprefix("attribute-"), progress=False)
            return
        with torch.no_grad():
            if method == "sdpa":
                model.model.set_attn_implementation("sdpa")
                model.model(input_ids=ids[None], use_cache=False, logits_to_keep=1)
            elif method in KERNELS_OF:
                kernels = KERNELS_OF[method]
                cw.trace(model, ids, maps=False, kernels=kernels, progress=False)
            elif method == "stream":
                cw.trace(
                    model,
                    ids,
                    measures="contribution",
                    storage_dtype="bfloat16",
                    out=folder,
                    overwrite=True,  # each repetition replaces the last
                    progress=False,
                )
            else:
                raise ValueError(method)

    cuda = ids.device.type == "cuda"
    if profile is not None:
        write_profile(once, cuda, profile)
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
    with Peak(str(ids.device)) as peak:
        start = time.perf_counter()
        once()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    disk = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    shutil.rmtree(folder, ignore_errors=True)
    return {
        "method": method,
        "tokens": int(ids.numel()),
        "seconds": seconds,
        "peak_mb": peak.peak / 2**20,
        "disk_mb": disk / 2**20,
    }


def write_profile(once: Any, cuda: bool, path: Path, rows: int = 30) -> None:
    """Run ``once`` under torch.profiler and write its operators' table to ``path``:
    sorted by self time on the GPU (CUDA) or the CPU, ``rows`` rows, with the wall time
    of the profiled run (which the profiler itself slows) at the top."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        once()
        if cuda:
            torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    if cuda:  # the kernels themselves, as the table's own total counts them (an operator's
        # self device time is its kernels' again)
        on_gpu = [e for e in events if e.device_type == DeviceType.CUDA]
        busy = sum(e.self_device_time_total for e in on_gpu if not e.is_user_annotation) / 1e6
    else:
        busy = sum(e.self_cpu_time_total for e in events) / 1e6
    table = events.table(sort_by=key, row_limit=rows, max_name_column_width=70)
    where = "on the GPU (kernels)" if cuda else "on the CPU (operators)"
    path.write_text(
        f"profiled run: {seconds:.3f} s wall under the profiler, {busy:.3f} s busy {where}\n"
        f"{table}\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--lengths", default="2048,8192")
    parser.add_argument("--methods", default="sdpa,no-maps,no-maps-compiled,no-maps-triton,stream")
    parser.add_argument("--tiny", action="store_true", help="a tiny model of the same family")
    parser.add_argument("--layers", type=int, default=None, help="this many of its layers")
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also profile each row once (torch.profiler, after the warm-up, not timed) and "
        "write its operators' table to OUT/profile-METHOD-T.txt",
    )
    args = parser.parse_args(argv)
    import torch

    model = build_model(args.tiny, args.device, args.dtype, args.layers)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for length in [int(x) for x in args.lengths.split(",")]:
        g = torch.Generator().manual_seed(length)
        ids = torch.randint(3, model.config.vocab_size, (length,), generator=g).to(args.device)
        for method in args.methods.split(","):
            folder = Path(tempfile.mkdtemp(prefix="cw-gpu-bench-"))
            # warmed up on the same input, so that kernels are compiled and tuned and the
            # allocator sized for this length (after a 64-token warm-up, the sdpa row of 2
            # layers at 8,192 tokens took 0.63 s on an H200, where bench_kv.py's prefill of
            # the same layers, warmed up on its own input, took 16 ms)
            run(model, method, ids, folder)
            folder = Path(tempfile.mkdtemp(prefix="cw-gpu-bench-"))
            profile = args.out / f"profile-{method}-{length}.txt" if args.profile else None
            r = run(model, method, ids, folder, profile)
            results.append(r)
            print(
                f"T={length:6d} {method:8s} {r['seconds']:8.2f} s  peak {r['peak_mb']:9.0f} MB"
                f"  disk {r['disk_mb']:9.0f} MB",
                flush=True,
            )
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.machine()
    machine = f"{device}, torch {torch.__version__}, model {model.name}, {args.dtype}"
    floor = {r["tokens"]: r["seconds"] for r in results if r["method"] == "sdpa"}
    lines = [
        f"Machine: {machine}",
        "",
        "| T | method | wall s | × sdpa | peak MB above model | disk MB |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        ratio = f"{r['seconds'] / floor[r['tokens']]:.2f}" if floor.get(r["tokens"]) else ""
        disk = f"{r['disk_mb']:.0f}" if r["disk_mb"] else ""
        lines.append(
            f"| {r['tokens']} | {r['method']} | {r['seconds']:.2f} | {ratio} | "
            f"{r['peak_mb']:.0f} | {disk} |"
        )
    (args.out / "bench_gpu.md").write_text("\n".join(lines) + "\n")
    (args.out / "bench_gpu.json").write_text(
        json.dumps(
            {"machine": machine, "layers": model.config.num_hidden_layers, "results": results},
            indent=2,
        )
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
