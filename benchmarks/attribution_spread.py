"""Top-1 on known-answer items over three settings of the fresh generator.

The runs are ``cw attribution-eval --generator fresh --seed S`` (S = 1, 2, 3: each seed
draws its own vocabulary range, item lengths, separators and phrasing), 64 items of at
most 64 tokens per task and model, methods direct, flow and input x gradient (AttnLRP
added to the finished runs by ``--resume --add-methods attnlrp``), one rate (0.1) and the
key_mask removal for the curves::

    cw attribution-eval --model M --task T --generator fresh --seed S --n 64 --tokens 64 \\
        --methods direct,flow,input_x_gradient --rates 0.1 --interventions key_mask \\
        --out docs/results/attribution-fresh/M-T-sS

This script reads their ``summary.csv`` and ``hits_paired.csv`` and writes
``spread.md``: per model, task and method the top-1 rate of each setting and their
range, and per setting the paired verdicts of direct against flow and AttnLRP (McNemar,
Holm).
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
METHODS = ("direct", "attnlrp", "flow", "input_x_gradient")
#: the methods direct is tested against, one verdict column each
VERSUS = ("flow", "attnlrp")


def csv_rows(path: Path) -> list[dict[str, str]]:
    """A run's CSV file (summary.csv, hits_paired.csv, paired.csv) as its rows."""
    with path.open() as fh:
        return list(csv.DictReader(fh))


def _verdict(run: Path, other: str) -> str:
    """direct against ``other`` in this run's paired top-1 tests, from direct's side."""
    pair = [
        r
        for r in csv_rows(run / "hits_paired.csv")
        if {r["reference"], r["other"]} == {"direct", other}
    ]
    if not pair:
        return "–"
    v = pair[0]["verdict"]
    if pair[0]["reference"] == other:
        return {"other better": "direct better", "reference better": f"{other} better"}.get(v, v)
    return {"reference better": "direct better", "other better": f"{other} better"}.get(v, v)


def spread_table(root: Path) -> str:
    """The Markdown table of ``spread.md`` from the run folders under ``root``: a method's
    row where at least one setting has it ("–" in the others)."""
    head = "| model | task | method | " + " | ".join(f"top-1 s{s}" for s in SEEDS)
    versus = " | ".join(f"direct vs {o} (s1, s2, s3)" for o in VERSUS)
    rule = "| --- | --- | --- | " + "---: | " * len(SEEDS) + "---: |" + " --- |" * len(VERSUS)
    lines = [f"{head} | range | {versus} |", rule]
    for model in MODELS:
        for task in TASKS:
            runs = [root / f"{model}-{task}-s{s}" for s in SEEDS]
            top1 = [{r["measure"]: float(r["top1"]) for r in csv_rows(run / "summary.csv")}
                    for run in runs]  # fmt: skip
            verdicts = [", ".join(_verdict(run, o) for run in runs) for o in VERSUS]
            for method in METHODS:
                vals = [t.get(method) for t in top1]
                held = [v for v in vals if v is not None]
                if not held:
                    continue
                cells = " | ".join("–" if v is None else f"{v:.2f}" for v in vals)
                extra = " | ".join(verdicts if method == "direct" else [""] * len(VERSUS))
                lines.append(
                    f"| {model} | {task} | {method} | {cells} | "
                    f"{min(held):.2f}–{max(held):.2f} | {extra} |"
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
