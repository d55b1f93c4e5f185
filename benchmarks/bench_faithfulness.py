"""Benchmark: faithfulness throughput, one process and two, and the sweep against eager.

``OMP_NUM_THREADS=1 python benchmarks/bench_faithfulness.py [--n 4] [--tokens 128,512]
[--processes 1,2] [--out DIR]``

On SmolLM2-135M (float32) and FineWeb-Edu texts of at least T tokens (from
``$CW_DATA_DIR``), cut to exactly T tokens, for each T:

* **sweep ÷ eager**, in this process: one sequence's sweep (every (measure, mode, rate)
  configuration plus the clean row: ``faithfulness.sequence_rows``, batched and chunked
  as a run does) against a plain batched forward of the same batch
  (same rows, same chunks, the model's own ``eager`` attention, and the same per-row
  next-token log-probabilities). Median of ``--repeats`` after a warm-up.
* **sequences per minute**, through the command line: ``python -m contribution_weights
  faithfulness`` with one process, and ``accelerate launch --multi_gpu --num_processes 2
  -m contribution_weights faithfulness`` with two single-thread CPU processes (gloo),
  on the same ``--n`` texts. Reported from the run's own clock (``run_info.json``:
  model loaded, all units, merge) and from the wall clock of the whole command
  (interpreter start and model load included).

On a GPU, ``--shape llama-8b --device cuda --layers 2`` times the sweep alone (no
command-line runs, no data) on a model of Llama-3.1-8B's shape with random bfloat16 weights
and random ids (``benchmarks/bench_gpu.py`` builds it), with the default options (80
configurations and the clean row), against plain forwards of the same batches with the
model's eager and sdpa attention, synchronising the device after each; ``--shape tiny
--device cpu`` runs the same code on a tiny model (the tests do)::

    python benchmarks/bench_faithfulness.py --shape llama-8b --device cuda --layers 2 \
        --tokens 512 --repeats 2 --out gpu-out/faithfulness

Every process runs one thread (``OMP_NUM_THREADS=1``): on a shared machine two OpenMP
threads of one process spin-wait on each other, while two processes of one thread each
share the cores cleanly. Results go to ``DIR/results.json`` and its table to
``DIR/results.md`` (``--table DIR/results.json`` writes the table again).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _timing import data_dir  # benchmarks/_timing.py, beside this script


def texts_of_length(model, tokens: int, n: int) -> list[list[int]]:
    import contribution_weights as cw

    out = []
    for text in cw.data.load_texts("fineweb-edu", 400):
        ids = model.tokenizer(text)["input_ids"]
        if len(ids) >= tokens:
            out.append(list(ids[:tokens]))
        if len(out) == n:
            return out
    raise SystemExit(f"fewer than {n} FineWeb-Edu texts have {tokens} tokens")


def sweep_vs_eager(
    model, ids, options, repeats: int, baselines: tuple[str, ...] = ("eager",)
) -> dict[str, float]:
    """Seconds of one sequence's sweep and of plain forwards of the same batch, with each
    attention implementation of ``baselines`` (``eager``, ``sdpa``)."""
    import torch

    from contribution_weights.experiments.faithfulness import sequence_rows
    from contribution_weights.interventions import DEFAULT_MEMORY_BYTES, auto_batch_size

    seq = torch.tensor(ids)
    rows = len(options.removals()) + 1
    chunk = auto_batch_size(model, seq.numel(), DEFAULT_MEMORY_BYTES)

    cuda = model.device.type == "cuda"

    def synced(fn):
        def call() -> None:
            fn()
            if cuda:
                torch.cuda.synchronize()

        return call

    @synced
    def sweep() -> None:
        sequence_rows(model, seq, options)

    @synced
    def plain() -> None:
        batch = seq[None].expand(rows, -1)
        with torch.no_grad():
            for start in range(0, rows, chunk):
                part = batch[start : start + chunk]
                logits = model.model(input_ids=part, use_cache=False).logits
                for b in range(part.shape[0]):  # as the sweep scores each row
                    logp = torch.log_softmax(logits[b, :-1].float(), dim=-1)
                    logp.gather(-1, part[b, 1:, None])

    previous = model.model.config._attn_implementation
    times: dict[str, list[float]] = {"sweep": [], **{name: [] for name in baselines}}
    sweep()  # warm-up
    try:
        for name in baselines:
            model.model.set_attn_implementation(name)
            plain()  # warm-up
        for _ in range(repeats):  # interleaved, so load drift hits all alike
            model.model.set_attn_implementation(previous)
            start = time.perf_counter()
            sweep()
            times["sweep"].append(time.perf_counter() - start)
            for name in baselines:
                model.model.set_attn_implementation(name)
                start = time.perf_counter()
                plain()
                times[name].append(time.perf_counter() - start)
    finally:
        model.model.set_attn_implementation(previous)
    median = {name: statistics.median(t) for name, t in times.items()}
    out: dict[str, float] = {
        "rows_per_sequence": rows,
        "rows_per_forward": min(chunk, rows),
        "sweep_seconds": round(median["sweep"], 4),
    }
    for name in baselines:
        out[f"{name}_forward_seconds"] = round(median[name], 4)
        out[f"sweep_over_{name}"] = round(median["sweep"] / median[name], 3)
    return out


def cli_run(args: list[str], processes: int, out: Path) -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    if processes == 1:
        cmd = [sys.executable, "-m", "contribution_weights", *args, "--out", str(out)]
    else:
        accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent))
        cmd = [
            str(accelerate), "launch", "--multi_gpu", "--num_processes", str(processes),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", "0", "-m", "contribution_weights", *args, "--out", str(out),
        ]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(done.stdout[-2000:] + done.stderr[-2000:])
    info = json.loads((out / "run_info.json").read_text())
    n = sum(1 for line in (out / "per_sequence.csv").open()) - 1
    return {"wall_seconds": round(wall, 1), "run_seconds": info["seconds"], "rows": n}


def markdown(report: dict) -> str:
    """The Markdown table of a ``results.json`` of the real-model run (not ``--shape``):
    per length the sweep against the plain eager forward, then the command-line runs."""
    procs = sorted(
        {
            int(k.split("_")[1])
            for e in report["by_tokens"].values()
            for k in e
            if k.startswith("processes_")
        }
    )
    lines = [
        f"{report['model']}, {report['cpu_count']} CPUs, {report['torch_threads']} torch "
        f"thread(s) per process, {report['machine']}; measures {report['measures']}, rates "
        f"{report['rates']}, both modes",
        "",
    ]
    header = [
        "T",
        "rows (per forward)",
        "one sequence's sweep",
        "plain eager forward",
        "sweep ÷ eager",
    ]
    header += [f"seq/min, {n} process{'es' * (n != 1)}" for n in procs]
    if len(procs) > 1:
        header.append(f"{procs[-1]} ÷ {procs[0]}")
    lines += ["| " + " | ".join(header) + " |", "|" + " ---: |" * len(header)]
    for tokens, entry in report["by_tokens"].items():
        ratio = entry["ratio"]
        cells = [
            f"{int(tokens):,}",
            f"{ratio['rows_per_sequence']} ({ratio['rows_per_forward']})",
            f"{ratio['sweep_seconds']:.1f} s",
            f"{ratio['eager_forward_seconds']:.1f} s",
            f"**{ratio['sweep_over_eager']:.2f}**",
        ]
        rates = [entry[f"processes_{n}"]["sequences_per_minute"] for n in procs]
        cells += [f"{r:.2f}" for r in rates]
        if len(procs) > 1:
            cells.append(f"{rates[-1] / rates[0]:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=4, help="texts per command-line run (default 4)")
    p.add_argument("--tokens", default="128,512", help="sequence lengths (default 128,512)")
    p.add_argument("--processes", default="1,2", help="process counts to run (default 1,2)")
    p.add_argument("--measures", default="attention,vw,vw_on,ihc")
    p.add_argument("--rates", default="0.1,0.3,0.5")
    p.add_argument("--repeats", type=int, default=3, help="sweep/eager timings (median)")
    p.add_argument("--model", default=None)
    p.add_argument("--out", type=Path, default=None, help="write results.json and results.md here")
    p.add_argument(
        "--table", type=Path, default=None, metavar="RESULTS.json",
        help="write the results.md of this results.json beside it and stop",
    )  # fmt: skip
    p.add_argument(
        "--shape", choices=["llama-8b", "tiny"], default=None,
        help="the sweep alone on a random model of this shape (default options, random ids)",
    )  # fmt: skip
    p.add_argument("--device", default="cpu", help="with --shape: where to build it")
    p.add_argument("--dtype", default="bfloat16", help="with --shape: its dtype")
    p.add_argument("--layers", type=int, default=None, help="with --shape: this many of its layers")
    args = p.parse_args()
    if args.table is not None:
        args.table.with_suffix(".md").write_text(markdown(json.loads(args.table.read_text())))
        return 0
    if args.shape is not None:
        return shaped(args)
    data_dir()  # $CW_DATA_DIR, checked

    import torch

    import contribution_weights as cw
    from contribution_weights.experiments.faithfulness import FaithfulnessOptions

    model = cw.load_model(args.model)
    report: dict[str, object] = {
        "model": model.name,
        "measures": args.measures,
        "rates": args.rates,
        "modes": "comprehensiveness,sufficiency",
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": platform.platform(),
        "by_tokens": {},
    }
    by_tokens: dict[str, object] = {}
    for tokens in (int(t) for t in args.tokens.split(",")):
        options = FaithfulnessOptions(measures=args.measures, rates=args.rates, max_tokens=tokens)
        seqs = texts_of_length(model, tokens, args.n)
        entry: dict[str, object] = {"ratio": sweep_vs_eager(model, seqs[0], options, args.repeats)}
        with tempfile.TemporaryDirectory() as tmp:
            texts = Path(tmp) / "texts.jsonl"
            with texts.open("w") as fh:
                for s in seqs:  # decoded back to text, re-encoded by the run to the same T
                    fh.write(json.dumps({"text": model.tokenizer.decode(s)}) + "\n")
            cli = ["faithfulness", "--texts", str(texts), "--measures", args.measures,
                   "--rates", args.rates, "--max-tokens", str(tokens)]  # fmt: skip
            if args.model:
                cli += ["--model", args.model]
            for procs in (int(x) for x in args.processes.split(",")):
                run = cli_run(cli, procs, Path(tmp) / f"run{procs}")
                run["sequences_per_minute"] = round(60 * args.n / run["run_seconds"], 2)
                run["sequences_per_minute_wall"] = round(60 * args.n / run["wall_seconds"], 2)
                entry[f"processes_{procs}"] = run
                print(tokens, procs, run, flush=True)
        print(tokens, entry["ratio"], flush=True)
        by_tokens[str(tokens)] = entry
    report["by_tokens"] = by_tokens
    report["load_average_at_end"] = os.getloadavg()
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(report, indent=2))
        (args.out / "results.md").write_text(markdown(report))
    return 0


def shaped(args: argparse.Namespace) -> int:
    """The sweep of one random text per length on a random model of ``--shape``, against
    plain eager and sdpa forwards of the same batches."""
    import torch
    from bench_gpu import build_model  # beside this script

    from contribution_weights.experiments.faithfulness import FaithfulnessOptions

    model = build_model(args.shape == "tiny", args.device, args.dtype, args.layers)
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        gen = torch.Generator().manual_seed(tokens)
        ids = torch.randint(3, model.config.vocab_size, (tokens,), generator=gen).tolist()
        options = FaithfulnessOptions(max_tokens=tokens)  # the defaults: 80 configurations
        ratio = sweep_vs_eager(model, ids, options, args.repeats, ("eager", "sdpa"))
        rows.append({"tokens": tokens, **ratio})
        print(json.dumps(rows[-1]), flush=True)
    report = {
        "model": model.name,
        "layers": model.config.num_hidden_layers,
        "dtype": args.dtype,
        "machine": torch.cuda.get_device_name()
        if model.device.type == "cuda"
        else platform.machine(),
        "torch": torch.__version__,
        "repeats": args.repeats,
        "rows": rows,
    }
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
