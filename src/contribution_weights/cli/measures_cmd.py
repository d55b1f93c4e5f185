"""``cw measures``: list the registered measures."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("measures", help="list the registered measures")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..measures.registry import get_measure, measure_names

    print(f"{'measure':14s} {'kind':9s} {'in all':6s} {'how a trace gets it':28s} description")
    for name in measure_names():
        m = get_measure(name)
        kind = "weight" if m.is_weight else "component"
        in_all = "yes" if m.in_all else "no"
        print(f"{name:14s} {kind:9s} {in_all:6s} {m.how:28s} {m.description}")
    print(
        "\n'all' (the default) is every measure marked 'yes'. distance costs T²·d per head and "
        "layer and is computed only when named; ihc is |contribution|.\nDerived measures are "
        "computed from the stored maps and the per-layer norms when they are read."
    )
    return 0
