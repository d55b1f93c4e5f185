"""``cw measures``: list the registered measures."""

from __future__ import annotations

import argparse

from ..measures.registry import get_measure, measure_names


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("measures", help="list the registered measures")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    for name in measure_names():
        m = get_measure(name)
        kind = "weight" if m.is_weight else "component"
        print(f"{name:14s} {kind:9s} {m.description}")
    return 0
