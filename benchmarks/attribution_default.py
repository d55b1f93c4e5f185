"""Which attribution method to default to: every candidate against every other method, on
each published known-answer run and deletion run of both embedded models.

The runs are ``docs/results/attribution-{smollm2,gemma3-270m}-{induction-64,lookup-64,
passkey-128,deletion-64}`` (``cw attribution-eval``, 64 items each). A candidate is a
method the runs hold paired tests for against every other method (a reference of their
``hits_paired.csv`` and ``paired.csv``: flow and the methods added to the runs). This
script writes ``default.md`` in ``docs/results/attribution-default``:

* known-answer runs: per run, whether the candidate's top-1 rate is the best, tied with
  every method above it (exact McNemar, Holm), or below one (named);
* deletion runs: per mode (comprehensiveness, sufficiency) and edit (key masking, mean
  embedding), at how many of the rates no method is better than the candidate (paired
  bootstrap, Holm), naming those that are.

``python benchmarks/attribution_default.py`` rebuilds it; tests/test_benchmark_tables.py
checks that the committed file is what the runs give.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from attribution_spread import csv_rows  # benchmarks/attribution_spread.py, beside this

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
MODELS = ("smollm2", "gemma3-270m")
KNOWN = ("induction-64", "lookup-64", "passkey-128")
MODES = ("comprehensiveness", "sufficiency")
EDITS = ("key_mask", "embedding")
CANDIDATES = ("direct", "direct_abs", "attnlrp", "attnlrp_abs", "flow", "flow_abs")


def _better_than(rows: list[dict[str, str]], method: str) -> set[str]:
    """The methods a paired test finds better than ``method`` in these rows."""
    out = set()
    for r in rows:
        if r["reference"] == method and r["verdict"] == "other better":
            out.add(r["other"])
        elif r["other"] == method and r["verdict"] == "reference better":
            out.add(r["reference"])
    return out


def _tested(rows: list[dict[str, str]], method: str) -> bool:
    return any(method in (r["reference"], r["other"]) for r in rows)


def _names(methods: set[str]) -> str:
    return ", ".join(sorted(methods))


def known_cell(run: Path, method: str) -> str:
    hits = csv_rows(run / "hits_paired.csv")
    if not any(r["reference"] == method for r in hits):
        return "–"
    top1 = {r["measure"]: float(r["top1"]) for r in csv_rows(run / "summary.csv") if r["top1"]}
    above = _better_than(hits, method)
    best = max(v for k, v in top1.items() if _tested(hits, k))
    word = "best" if top1[method] == best else "tied" if not above else f"< {_names(above)}"
    return f"{top1[method]:.2f} {word}"


def curve_cell(run: Path, method: str, mode: str, edit: str) -> str:
    rows = [
        r for r in csv_rows(run / "paired.csv")
        if r["mode"] == mode and r["intervention"] == edit
    ]  # fmt: skip
    if not any(r["reference"] == method for r in rows):
        return "–"
    rates = sorted({r["rate"] for r in rows}, key=float)
    beaten = {rate: _better_than([r for r in rows if r["rate"] == rate], method) for rate in rates}
    clear = sum(not b for b in beaten.values())
    by = set().union(*beaten.values())
    return f"{clear}/{len(rates)}" + (f" (< {_names(by)})" if by else "")


def default_table(root: Path = RESULTS) -> str:
    lines = ["# Best or tied with the best, per published run", ""]
    head = ["method"] + [f"{m} {t.split('-')[0]} top-1" for m in MODELS for t in KNOWN]
    lines += ["## Known-answer tasks: top-1 (token 0 excluded)", ""]
    lines += ["| " + " | ".join(head) + " |", "| --- |" + " --- |" * (len(head) - 1)]
    for method in CANDIDATES:
        cells = [known_cell(root / f"attribution-{m}-{t}", method) for m in MODELS for t in KNOWN]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    head = ["method"] + [f"{m} {mode} {edit}" for m in MODELS for mode in MODES for edit in EDITS]
    lines += ["", "## Deletion curves: rates at which no method is better", ""]
    lines += ["| " + " | ".join(head) + " |", "| --- |" + " --- |" * (len(head) - 1)]
    for method in CANDIDATES:
        cells = [
            curve_cell(root / f"attribution-{m}-deletion-64", method, mode, edit)
            for m in MODELS for mode in MODES for edit in EDITS
        ]  # fmt: skip
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=RESULTS / "attribution-default")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    table = default_table()
    (args.out / "default.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
