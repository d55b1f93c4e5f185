"""``cw show``: read a saved trace: a query's top tokens at a layer, and the sink verdict."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import TYPE_CHECKING

from ..defaults import SINK_LAYER_THRESHOLD
from .common import add_command

if TYPE_CHECKING:
    import pandas as pd


#: the command's line in ``cw --help``, and the text atop its own ``--help``
HELP = "a query's top tokens at a layer, and which layers are attention sinks"
DESCRIPTION = """Read a trace folder written by `cw trace --out`. With --layer: the tokens the
query draws on most at that layer, ranked by their share of --measure summed over heads (the
shares of a query sum to 1 over heads and keys: attention α/H, contribution ĉ), attention beside
contribution. Always: per layer, the mean attention to token 0, token 0's share of the
contribution, and whether the layer is a sink layer (attention to token 0 above --threshold)."""


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "show", run, HELP, DESCRIPTION)
    p.add_argument("trace", type=Path, metavar="TRACE", help="a folder written by cw trace --out")
    p.add_argument(
        "--layer",
        type=int,
        default=None,
        help="model layer whose query to show (negative counts from the model's last layer, "
        "written with '=': --layer=-1)",
    )
    p.add_argument(
        "--query",
        type=int,
        default=-1,
        help="query position (default -1, the last token; negative counts from the end)",
    )
    p.add_argument("--top", type=int, default=8, help="tokens listed (default 8)")
    p.add_argument(
        "--measure",
        default="contribution",
        help="weight measure the tokens are ranked by (default contribution)",
    )
    p.add_argument("--heads", action="store_true", help="add each head's part of the share")
    p.add_argument("--exclude-first", action="store_true", help="leave token 0 out of the ranking")
    p.add_argument(
        "--threshold",
        type=float,
        default=SINK_LAYER_THRESHOLD,
        help="a layer is a sink layer when its mean attention to token 0 is above this "
        f"(default {SINK_LAYER_THRESHOLD}, as the geometry analysis)",
    )


def run(args: argparse.Namespace) -> int:
    from ..inputs import InputError

    if args.top < 1:
        raise InputError(f"--top must be at least 1, not {args.top}")
    if not 0 <= args.threshold <= 1:
        raise InputError(f"--threshold is a mean attention weight, in [0, 1]; not {args.threshold}")
    from ..tracing.folder import describe_trace
    from ..tracing.result import Trace

    trace = Trace.load(args.trace)
    print(f"{args.trace}: {describe_trace(args.trace)}")
    sinks = None
    if "attention" in trace.measures:
        sinks = trace.sinks(args.threshold)
    if args.layer is None:
        if sinks is None:
            print("no sink verdict: the trace has no attention measure")
        else:
            print(format_sinks(sinks))
        print(f"a query's top tokens: cw show {args.trace} --layer LAYER [--query -1] [--top 8]")
        return 0
    try:
        table = trace.top_tokens(
            args.layer, args.query, args.top, args.measure, args.heads, args.exclude_first
        )
    except (KeyError, ValueError) as err:
        raise InputError(str(err).strip("'\"")) from None
    print(format_top(table))
    if sinks is not None:
        print(sink_line(sinks, table.attrs["layer"], table.attrs["first"]))
    return 0


def _token(text: str, width: int = 18) -> str:
    shown = repr(text)
    return shown if len(shown) <= width else shown[: width - 2] + "…'"


def format_top(table: pd.DataFrame) -> str:
    """The table of :meth:`~..tracing.result.Trace.top_tokens` as text, with a heading that
    says what it ranks and how exact it is."""
    a = table.attrs
    lines = [
        f"layer {a['layer']}, query {a['query']}: the {len(table)} tokens with the largest "
        f"share of {a['measure']} (summed over heads; a query's shares sum to 1)"
    ]
    if not a["exact"]:
        lines.append(
            "  (a trace without maps: each head's top-k keys only; a key outside a head's "
            "top k counts 0 there; trace with maps or a larger --top-k for exact sums)"
        )
    values = [c for c in table.columns if c not in ("position", "token")]
    header = f"{'rank':>4} {'pos':>6}  {'token':<18}" + "".join(f" {c:>12}" for c in values)
    lines.append(header)
    for rank, row in enumerate(table.itertuples(index=False), start=1):
        cells = dict(zip(table.columns, row, strict=True))
        line = f"{rank:>4} {cells['position']:>6}  {_token(str(cells['token'])):<18}"
        line += "".join(f" {cells[c]:>12.4f}" for c in values)
        lines.append(line)
    return "\n".join(lines)


def format_sinks(sinks: pd.DataFrame) -> str:
    """The per-layer sink table of :meth:`~..tracing.result.Trace.sinks` as text."""
    threshold = sinks.attrs.get("threshold", SINK_LAYER_THRESHOLD)
    n = int(sinks["sink"].sum())
    lines = [
        f"attention sinks: {n} of {len(sinks)} layers give token 0 more than {threshold:g} "
        "of their attention (mean over queries and heads)",
        f"{'layer':>5} {'attention to 0':>15} {'contribution of 0':>18}  sink",
    ]
    for layer, row in sinks.iterrows():
        contribution = row["contribution_of_first"]
        shown = "-" if math.isnan(contribution) else f"{contribution:.3f}"
        flag = "yes" if row["sink"] else "no"
        lines.append(f"{layer:>5} {row['attention_to_first']:>15.3f} {shown:>18}  {flag}")
    return "\n".join(lines)


def sink_line(sinks: pd.DataFrame, layer: int, first: dict[str, float]) -> str:
    """One layer's verdict, with token 0's share at the query shown."""
    row = sinks.loc[layer]
    threshold = sinks.attrs.get("threshold", SINK_LAYER_THRESHOLD)
    verdict = "a sink layer" if row["sink"] else "not a sink layer"
    contribution = row["contribution_of_first"]
    text = (
        f"layer {layer} is {verdict}: token 0 gets {row['attention_to_first']:.3f} of its "
        f"attention (threshold {threshold:g})"
    )
    if not math.isnan(contribution):
        text += f" and gives {contribution:.3f} of its contribution"
    at_query = ", ".join(f"{name} {share:.3f}" for name, share in first.items())
    return text + f"; at this query token 0's share is {at_query}"
