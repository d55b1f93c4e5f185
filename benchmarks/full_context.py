"""The full-context table of docs/performance.md, from the runs' result files.

``python benchmarks/full_context.py [--add bench_trace-MODEL-tN.json --note TEXT]``

Each run at a model's full context is one file, ``docs/results/bench-trace/MODEL-METHOD-T.json``
(one result of ``benchmarks/bench_trace.py``: method, tokens, seconds, peak_mb, disk_mb,
note). ``--add`` files the results of a ``bench_trace.py`` run (its ``--out`` folder's
JSON) there, one file per result, with ``--note`` saying what else ran on the machine. The
table, ``full-context.md`` in that folder, is then written again from every such file:
wall time, the ratio to the same model's sdpa forward at the same length, peak memory
above the loaded model and the size on disk.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

FOLDER = Path(__file__).resolve().parents[1] / "docs" / "results" / "bench-trace"
MODELS = {"smollm2": "SmolLM2-135M", "gemma3-270m": "Gemma 3 270M"}
#: the runs as the table names them, in its order
METHODS = {
    "sdpa": "sdpa (the model's own forward)",
    "no-maps": "`--no-maps`, default measures",
    "stream-f16": "`--out`, contribution + attention, float16",
}
NAME = re.compile(rf"^(?P<model>{'|'.join(MODELS)})-(?P<method>{'|'.join(METHODS)})-(?P<t>\d+)$")


def runs(folder: Path = FOLDER) -> list[tuple[str, dict]]:
    """(model, result) of every full-context file, in the table's order."""
    found = []
    for path in folder.glob("*.json"):
        match = NAME.match(path.stem)
        if match:
            found.append((match["model"], json.loads(path.read_text())))
    order = list(MODELS), list(METHODS)
    return sorted(
        found, key=lambda r: (order[0].index(r[0]), r[1]["tokens"], order[1].index(r[1]["method"]))
    )


def table(folder: Path = FOLDER) -> str:
    found = runs(folder)
    sdpa = {(m, r["tokens"]): r["seconds"] for m, r in found if r["method"] == "sdpa"}
    lines = [
        "| model | T | run | wall s | × sdpa | peak MB above the loaded model | on disk |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for model, r in found:
        floor = sdpa.get((model, r["tokens"]))
        ratio = f"{r['seconds'] / floor:.1f}" if floor else ""
        disk = f"{r['disk_mb'] / 1024:.1f} GiB" if r.get("disk_mb") else ""
        lines.append(
            f"| {MODELS[model]} | {r['tokens']} | {METHODS[r['method']]} | {r['seconds']:.0f} | "
            f"{ratio} | {r['peak_mb']:.0f} | {disk} |"
        )
    return "\n".join(lines) + "\n"


def add(results: Path, note: str, folder: Path = FOLDER) -> list[Path]:
    """File each result of a bench_trace.py run as MODEL-METHOD-T.json."""
    run = json.loads(results.read_text())
    model = run["machine"].rsplit("model ", 1)[-1]
    if model not in MODELS:
        raise SystemExit(f"{results}: model {model!r} is not one of {', '.join(MODELS)}")
    written = []
    for r in run["results"]:
        if r.get("seconds") is None or r["method"] not in METHODS:
            continue
        path = folder / f"{model}-{r['method']}-{r['tokens']}.json"
        path.write_text(json.dumps({**r, "note": f"{note}; {run['machine']}"}) + "\n")
        written.append(path)
    return written


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--add", type=Path, default=None, help="a bench_trace.py run's JSON to file")
    p.add_argument("--note", default="", help="with --add: what else ran on the machine")
    args = p.parse_args()
    if args.add is not None:
        for path in add(args.add, args.note):
            print(f"wrote {path}")
    written = table()
    (FOLDER / "full-context.md").write_text(written)
    print(written)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
