"""The GPU checks' one table: every timed case against its baseline and its target.

Reads what ``benchmarks/gpu_checks.sh`` wrote (``bench_kv.py``'s JSON, one or more of
``bench_gpu.py``'s and ``bench_faithfulness.py --shape``'s) and writes ``summary.json``
and ``summary.md``: per case, the tokens, the layers of the 8B-shaped model that ran, the
wall time, the baseline measured in the same run (the sdpa forward of the same layers and
tokens; the prefill for the KV rows; plain sdpa forwards of the same batches for the
faithfulness sweep), the ratio, the target, whether the target is met, and the peak memory
above the model.

    python benchmarks/gpu_summary.py --kv gpu-out/bench_kv.json \\
        --trace gpu-out/trace/bench_gpu.json --trace gpu-out/whole/bench_gpu.json --out gpu-out
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

#: the largest ratio to the baseline each case aims at (None: no target, reported only)
TRACE_TARGETS = {"no-maps": 4.0, "no-maps-compiled": 4.0, "no-maps-triton": 4.0, "stream": None}
KV_CASES = [  # (bench_kv.py's seconds key, the case's name, the target over the prefill)
    ("capture_s", "capture, no observer", 1.1),
    ("scored_s", "KV scoring, every method", 3.0),
    ("scored_triton_s", "KV scoring, every method, tiled kernels", 3.0),
    ("windowed_s", "KV scoring, window methods", None),
]


def _layers(described: str) -> int | None:
    """The layers that ran, from a model description ("…, 2 of its 32 layers")."""
    found = re.search(r"(\d+) of its (\d+) layers", described)
    if found:
        return int(found.group(1))
    found = re.search(r"(\d+) layers", described)
    return int(found.group(1)) if found else None


def _row(case: str, tokens: int, layers: Any, seconds: float, base: float | None, **extra: Any):
    ratio = seconds / base if base else None
    target = extra.pop("target", None)
    return {
        "case": case,
        "tokens": tokens,
        "layers": layers,
        "seconds": round(seconds, 4),
        "baseline_seconds": None if base is None else round(base, 4),
        "ratio": None if ratio is None else round(ratio, 2),
        "target": target,
        "meets": None if target is None or ratio is None else ratio <= target,
        **extra,
    }


def trace_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """bench_gpu.py's rows against the sdpa row of the same tokens."""
    layers = result.get("layers") or _layers(result.get("machine", ""))
    floor = {r["tokens"]: r["seconds"] for r in result["results"] if r["method"] == "sdpa"}
    rows = []
    for r in result["results"]:
        if r["method"] == "sdpa":
            continue
        extra: dict[str, Any] = {"peak_mb": round(r["peak_mb"])}
        if r.get("disk_mb"):
            extra["disk_mb"] = round(r["disk_mb"])
        target = TRACE_TARGETS.get(r["method"])
        base = floor.get(r["tokens"])
        case = f"trace {r['method']}"
        if r["method"].startswith("attribute-"):  # cw.attribute's cost over one forward
            case, target = f"attribution {r['method'].removeprefix('attribute-')}", 1.5
        rows.append(_row(case, r["tokens"], layers, r["seconds"], base, target=target, **extra))
    return rows


def kv_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """bench_kv.py's ratios to the prefill of the same context."""
    layers = result.get("layers") or _layers(result.get("model", ""))
    rows = []
    for r in result["rows"]:
        for seconds_key, case, target in KV_CASES:
            if seconds_key not in r:
                continue
            peak = r.get("peak_mb", {}).get(seconds_key.removesuffix("_s"))
            extra: dict[str, Any] = {"target": target}
            if peak is not None:
                extra["peak_mb"] = round(peak)
            rows.append(_row(case, r["context"], layers, r[seconds_key], r["prefill_s"], **extra))
    return rows


def faithfulness_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """bench_faithfulness.py --shape: one text's sweep against plain sdpa forwards of the
    same batches."""
    rows = []
    for r in result["rows"]:
        case = f"faithfulness sweep, one text ({r['rows_per_sequence'] - 1} configurations)"
        seconds, base = r["sweep_seconds"], r["sdpa_forward_seconds"]
        rows.append(_row(case, r["tokens"], result.get("layers"), seconds, base, target=2.0))
    return rows


def markdown(rows: list[dict[str, Any]], machine: str) -> str:
    lines = [
        f"Machine: {machine}",
        "",
        "| case | tokens | layers | wall s | baseline s | × baseline | target | met | peak MB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for r in rows:
        cells = [
            r["case"],
            str(r["tokens"]),
            "" if r["layers"] is None else str(r["layers"]),
            f"{r['seconds']:.3f}",
            "" if r["baseline_seconds"] is None else f"{r['baseline_seconds']:.3f}",
            "" if r["ratio"] is None else f"{r['ratio']:.2f}",
            "" if r["target"] is None else f"≤ {r['target']:g}",
            {True: "yes", False: "no", None: ""}[r["meets"]],
            "" if r.get("peak_mb") is None else str(r["peak_mb"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kv", type=Path, default=None, help="bench_kv.py's JSON")
    p.add_argument("--trace", type=Path, action="append", default=[], help="bench_gpu.py's JSON")
    p.add_argument(
        "--faithfulness", type=Path, default=None, help="bench_faithfulness.py --shape's JSON"
    )
    p.add_argument("--out", type=Path, required=True, help="folder for summary.json/.md")
    args = p.parse_args(argv)
    rows: list[dict[str, Any]] = []
    machines = []
    missing = []
    inputs = [(path, trace_rows) for path in args.trace]
    inputs += [(path, kv_rows) for path in [args.kv] if path is not None]
    inputs += [(path, faithfulness_rows) for path in [args.faithfulness] if path is not None]
    for path, rows_of in inputs:
        if not path.exists():  # the step that writes it failed or ran out of time
            missing.append(str(path))
            continue
        result = json.loads(path.read_text())
        machine = str(result.get("machine", ""))  # bench_gpu.py's names torch already
        torch = result.get("torch")
        machines.append(f"{machine}, torch {torch}" if torch else machine)
        rows += rows_of(result)
    machine = "; ".join(dict.fromkeys(m for m in machines if m)) or "unknown"
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"machine": machine, "rows": rows, "missing": missing}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    text = markdown(rows, machine)
    if missing:  # a step that timed out or failed wrote nothing: say so in the table
        text += "\nNo results (the step failed or ran out of time): " + ", ".join(missing) + "\n"
    (args.out / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
