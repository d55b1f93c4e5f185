"""Top-1 on known-answer items over three settings of the fresh generator.

The runs are ``cw attribution-eval --generator fresh --seed S`` (S = 1, 2, 3: each seed
draws its own vocabulary range, item lengths, separators and phrasing), 64 items of at
most 64 tokens per task and model, methods direct, flow and input x gradient, one rate
(0.1) and the key_mask removal for the curves::

    cw attribution-eval --model M --task T --generator fresh --seed S --n 64 --tokens 64 \\
        --methods direct,flow,input_x_gradient --rates 0.1 --interventions key_mask \\
        --out docs/results/attribution-fresh/M-T-sS

This script reads their ``summary.csv`` and ``hits_paired.csv`` and writes
``spread.md``: per model, task and method the top-1 rate of each setting and their
range, and per setting the paired verdict of direct against flow (McNemar, Holm).
``python benchmarks/attribution_spread.py docs/results/attribution-fresh`` rebuilds it;
tests/test_attribution_spread.py checks that the committed file is what the runs give.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

MODELS = ("smollm2", "gemma3-270m")
TASKS = ("induction", "lookup", "passkey")
SEEDS = (1, 2, 3)
METHODS = ("direct", "flow", "input_x_gradient")


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open() as fh:
        return list(csv.DictReader(fh))


def spread_table(root: Path) -> str:
    """The Markdown table of ``spread.md`` from the run folders under ``root``."""
    head = "| model | task | method | " + " | ".join(f"top-1 s{s}" for s in SEEDS)
    lines = [head + " | range | direct vs flow (s1, s2, s3) |",
             "| --- | --- | --- | " + "---: | " * len(SEEDS) + "---: | --- |"]  # fmt: skip
    for model in MODELS:
        for task in TASKS:
            runs = [root / f"{model}-{task}-s{s}" for s in SEEDS]
            top1 = [{r["measure"]: float(r["top1"]) for r in _rows(run / "summary.csv")}
                    for run in runs]  # fmt: skip
            verdicts = []
            for run in runs:
                pair = [r for r in _rows(run / "hits_paired.csv")
                        if {r["reference"], r["other"]} == {"direct", "flow"}]  # fmt: skip
                v = pair[0]["verdict"] if pair else "–"
                if pair and pair[0]["reference"] == "flow":
                    v = {"other better": "direct better", "reference better": "flow better"}.get(
                        v, v
                    )
                verdicts.append(v)
            for method in METHODS:
                vals = [t[method] for t in top1]
                cells = " | ".join(f"{v:.2f}" for v in vals)
                extra = ", ".join(verdicts) if method == "direct" else ""
                lines.append(
                    f"| {model} | {task} | {method} | {cells} | "
                    f"{min(vals):.2f}–{max(vals):.2f} | {extra} |"
                )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root", type=Path, nargs="?", default=Path("docs/results/attribution-fresh"))
    args = p.parse_args()
    out = args.root / "spread.md"
    out.write_text(spread_table(args.root))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
