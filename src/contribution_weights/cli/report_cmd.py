"""``cw report``: one self-contained interactive HTML page for a text or a saved trace."""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

from ..presentation.report_data import DEFAULT_MAX_BYTES, DEFAULT_MEASURES, PRECISIONS
from ..progress import status
from .common import (
    _input_error,
    add_command,
    add_model_arguments,
    add_newline_argument,
    add_trace_arguments,
    check_out_file,
    parse_bytes,
    read_text,
)

#: the command's line in ``cw --help``, and the text atop its own ``--help``
HELP = "write an interactive, self-contained HTML report of a trace"
DESCRIPTION = """Trace a text (or load a saved trace folder) and write one HTML file that opens
offline in any browser: hover a token to see what it reads, heatmaps of attention vs
contribution, first-token weight per layer and the summary."""


def parse_size(value: str) -> int | None:
    """``--max-bytes``: a size as every option takes one (``64M``, ``20MB``, ``32MiB``; see
    :func:`~..fields.as_bytes`), or ``0``/``none`` for no limit."""
    if value.strip().lower() in ("0", "none", "inf", "unlimited"):
        return None
    return parse_bytes(value)


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "report", run, HELP, DESCRIPTION)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="the text to trace")
    src.add_argument("--file", type=Path, help="read the text from a file ('-' for stdin)")
    src.add_argument("--example", action="store_true", help="trace the packaged example text")
    src.add_argument("--trace", type=Path, help="a folder written by `cw trace --out`")
    add_newline_argument(p)
    add_model_arguments(p)
    add_trace_arguments(
        p,
        None,
        "comma-separated measures to trace and embed (default: "
        f"{','.join(DEFAULT_MEASURES)}, but distance, slow, is traced only when named; from "
        "a --trace folder, those of them it holds; 'all' for every traced one)",
        "layers to embed, e.g. 0,5,-1 or 0-3",
    )
    p.add_argument(
        "--max-bytes",
        type=parse_size,
        default=DEFAULT_MAX_BYTES,
        help="size limit of the file, e.g. 20MB or 20MiB "
        f"(default {DEFAULT_MAX_BYTES // 2**20}MiB; 0: none); "
        "over it, evenly spaced layers are kept and a warning says which",
    )
    p.add_argument(
        "--precision",
        default="uint8",
        choices=PRECISIONS,
        help="uint8: 8 bits per value, scaled per query row (default); float16: 2 bytes",
    )
    p.add_argument(
        "--view",
        default="auto",
        choices=["auto", "full", "long"],
        help="full: every T x T map (size grows as T^2); long: per-token heat over the whole "
        "text and the maps of a window of queries (linear in T; the only view of a "
        "--no-maps trace; default size limit 20 MiB); auto (default): full up to 1,024 tokens",
    )
    p.add_argument(
        "--window",
        type=_window,
        default=None,
        metavar="START:STOP",
        help="long view: the queries whose maps are embedded (default: the last 128)",
    )
    p.add_argument("--title", default=None, help="page title")
    p.add_argument("--out", type=Path, required=True, help="the HTML file to write")


def _window(value: str) -> tuple[int, int]:
    start, sep, stop = value.partition(":")
    try:
        if not sep:
            raise ValueError
        lo, hi = int(start), int(stop)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not START:STOP (query positions, e.g. 3968:4096)"
        ) from None
    if hi <= lo:
        raise argparse.ArgumentTypeError(
            f"{value!r} is an empty window: STOP must be above START (e.g. 3968:4096)"
        )
    return lo, hi


def run(args: argparse.Namespace) -> int:
    from ..presentation.report import ReportSizeWarning, traced_measures, write_report
    from ..tracing.result import Trace

    check_out_file(args.out)  # before any tracing or loading
    if args.window is not None and args.view == "full":
        raise _input_error(
            "--window chooses the queries of the long view; the full view shows every "
            "query: drop --window or use --view long"
        )
    if args.window is not None and args.view == "auto":
        args.view = "long"  # a window of queries is what the long view shows
    if args.trace is not None:
        given = [
            flag
            for flag, value in (
                ("--model", args.model), ("--dtype", args.dtype), ("--device", args.device),
                ("--max-tokens", args.max_tokens), ("--truncate", args.truncate or None),
            )
            if value is not None
        ]  # fmt: skip
        if given:
            raise _input_error(
                f"a --trace folder is reported as it was traced (its model, dtype and tokens "
                f"are in the folder): drop {', '.join(given)}"
            )
    if args.max_tokens is not None and args.max_tokens < 1:
        raise _input_error(f"--max-tokens must be at least 1, not {args.max_tokens}")
    if args.trace is not None:
        result = Trace.load(args.trace)
        if not result.has_maps and args.view == "full":
            import shlex

            from ..inputs import InputError

            flag = f" --model {shlex.quote(result.model_name)}" if result.model_name else ""
            raise InputError(
                f"{args.trace} holds no maps: it was written by `cw trace --no-maps`, which "
                "keeps only per-(layer, head) reductions (token scores, first-token weight, "
                "entropy, top-k keys), and the full view shows T x T maps. Use the long view "
                f"(--view long or auto), or trace the text again without --no-maps, e.g. "
                f"`cw trace --file TEXT{flag} --out DIR --measures attention,contribution "
                "--storage-dtype float16` (maps streamed to disk, in half the space)"
            )
        layers = args.layers
        if layers is not None:
            total = int(result.meta.get("num_layers", 0))
            if total:  # else write_report names the traced layers for a bad index
                from ..inputs import resolve_layers

                layers = resolve_layers(layers, total)
    else:
        from ..loading import load_model
        from ..tracing import trace

        text = read_text(args)
        with status(f"loading {args.model or 'smollm2'}"):
            model = load_model(args.model, dtype=args.dtype, device=args.device)
        # the report's defaults; distance (slow: T²·d per head and layer) only when named
        measures = args.measures or ",".join(traced_measures())
        start = time.perf_counter()
        result = trace(
            model,
            text,
            measures=measures,
            layers=args.layers,
            max_tokens=args.max_tokens,
            truncate=args.truncate,
            progress=True,  # a bar per layer: with distance, minutes at a few hundred tokens
        )
        print(
            f"{model.name}: traced {result.num_tokens} tokens, {len(result.layers)} layers in "
            f"{time.perf_counter() - start:.1f} s"
        )
        layers = None  # the trace already holds just the requested layers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReportSizeWarning)  # printed below instead
        info = write_report(
            result,
            args.out,
            measures=args.measures,
            layers=layers,
            max_bytes=args.max_bytes,
            precision=args.precision,
            title=args.title,
            view=args.view,
            window=args.window,
        )
    print(
        f"wrote {info.path} ({info.size_bytes / 2**20:.2f} MiB; {info.view} view; "
        f"{len(info.layers)} of {len(result.layers)} layers; measures "
        f"{', '.join(info.measures)}; {info.precision})"
    )
    for note in info.warnings:
        print(f"warning: {note}")
    return 0
