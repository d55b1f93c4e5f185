"""``cw trace``: trace a text and write tensors, tokens, summary and figures."""

from __future__ import annotations

import argparse

from .common import add_model_arguments, add_text_arguments


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="trace a text: per-layer, per-head measures and figures")
    add_text_arguments(p)
    add_model_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    raise NotImplementedError
