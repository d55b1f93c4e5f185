"""``cw measures``: list the registered measures."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("measures", help="list the registered measures")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..measures.registry import get_measure, measure_names

    header = ("measure", "kind", "in all", "how a trace gets it", "description")
    rows = []
    for name in measure_names():
        m = get_measure(name)
        kind = "weight" if m.is_weight else "component"
        rows.append((name, kind, "yes" if m.in_all else "no", m.how, m.description))
    # every column but the last as wide as its longest entry, so descriptions line up
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header) - 1)]
    for row in (header, *rows):
        print(" ".join([*(cell.ljust(w) for cell, w in zip(row, widths, strict=False)), row[-1]]))
    print(
        "\n'all' (the default) is every measure marked 'yes'. distance costs T²·d per head and "
        "layer and is computed only when named; ihc is |contribution|.\nDerived measures are "
        "computed from the stored maps and the per-layer norms when they are read."
    )
    return 0
