"""``cw trace``: trace a text and write tensors, tokens, summary and figures."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..defaults import DEFAULT_TOP_K, KERNEL_PRECISIONS, KERNELS, STORAGE_DTYPE_NAMES
from .common import (
    add_command,
    add_model_arguments,
    add_text_arguments,
    add_trace_arguments,
    check_heads,
    check_out_dir,
    parse_bytes,
    plural,
    read_text,
)

if TYPE_CHECKING:
    from ..tracing import TraceOptions


#: the command's line in ``cw --help``, and the text atop its own ``--help``
HELP = "trace a text: per-layer, per-head measures, summary and figures"
DESCRIPTION = """Trace a text through the model, streaming each layer's maps to DIR/maps/ as it
is done (packed lower triangles), with DIR/vectors.safetensors, DIR/tokens.json, DIR/meta.json,
DIR/summary.json and figures. --no-maps keeps only per-(layer, head) reductions. Before it
starts, the trace's memory and disk needs are estimated; when they do not fit it stops with the
options that would."""


def _pairs(value: str) -> list[tuple[int, int]]:
    out = []
    for part in value.split(","):
        layer, sep, head = part.strip().partition(":")
        try:
            if not sep:
                raise ValueError
            out.append((int(layer), int(head)))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{part!r} is not LAYER:HEAD (e.g. 0:3,15:2,-1:0)"
            ) from None
    return out


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "trace", run, HELP, DESCRIPTION)
    add_text_arguments(p)
    add_model_arguments(p)
    add_trace_arguments(
        p,
        "all",
        "comma-separated measures or 'all' = every measure but distance, ihc and "
        "projection (`cw measures` lists them and which are in all; an unknown name is "
        "answered with the list)",
        "layers to trace, e.g. 0,5,-1 or 0-3",
    )
    p.add_argument(
        "--compute-dtype",
        default="float32",
        choices=["float32", "float64"],
        help="dtype the measures are computed in (default float32)",
    )
    p.add_argument(
        "--storage-dtype",
        default=None,
        choices=STORAGE_DTYPE_NAMES,
        help="dtype of the maps on disk (default: the compute dtype); float16 or bfloat16 "
        "halve the size (docs/long-contexts.md gives the error they add)",
    )
    p.add_argument(
        "--no-maps",
        action="store_true",
        help="keep no T x T map: only token scores, first-token weight, entropy and the "
        "top-k keys per (layer, head), computed while the forward runs",
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=DEFAULT_TOP_K,
        help=f"keys kept per query in the reductions (default {DEFAULT_TOP_K})",
    )
    p.add_argument(
        "--exact-inputs",
        action="store_true",
        help="run untraced layers through eager attention too (default: sdpa, faster; "
        "the traced layers' inputs then differ from an all-eager forward by float rounding)",
    )
    p.add_argument(
        "--kernels",
        choices=KERNELS,
        default="auto",
        help="how blocks are reduced: compiled with torch.compile (fused loops; a first "
        "compile takes 10-60 s, then cached), plain torch, or auto (the one measured "
        "faster on the device: plain torch so far; compiling measured slower on CPUs), "
        "or triton (with --no-maps: each traced layer reduced whole by tiled Triton "
        "kernels that never build a T x T map, for GPUs; on CPUs it runs in Triton's "
        "slow interpreter) (default auto)",
    )
    p.add_argument(
        "--kernel-precision",
        choices=KERNEL_PRECISIONS,
        default="ieee",
        help="the products of --kernels triton: ieee (float32, exact to its rounding), or "
        "tf32 / bf16 tensor-core operands with float32 sums, faster on GPUs within the "
        "error budget docs/long-contexts.md states (default ieee)",
    )
    p.add_argument(
        "--memory-limit",
        type=parse_bytes,
        default=None,
        help="memory the trace may use, e.g. 8G (default: what the machine has available)",
    )
    p.add_argument(
        "--heads",
        type=_pairs,
        default=None,
        help="LAYER:HEAD pairs for the heatmap figure (default: the heads where attention and "
        "contribution disagree most on token 0, in 3 layers); negative layers count from the "
        "end, written with '=': --heads=-1:0",
    )
    p.add_argument("--no-figures", action="store_true", help="skip the PNG figures")
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a trace already in --out (without it such a folder is refused, naming "
        "the trace it holds)",
    )


def run(args: argparse.Namespace) -> int:
    # everything that can be checked is checked before the model loads, and what needs
    # no model before torch is imported (a missing --file or a bad --out answer at once)
    check_out_dir(args.out)
    if not args.overwrite:
        from ..tracing.folder import refuse_to_replace

        refuse_to_replace(args.out)  # an earlier trace is named, before the model loads
    text = read_text(args)
    from ..inputs import InputError, resolve_layers
    from ..loading import peek_dims
    from ..measures.registry import resolve_measures
    from ..tracing import TraceOptions

    if not text.strip():
        raise InputError("the text is empty; pass some text to trace")
    names = resolve_measures(args.measures)  # an unknown measure names the valid ones
    if args.kernels == "triton":
        # before the model loads: loading imports triton, which must learn first whether
        # to interpret (CPU tensors) or compile
        import torch

        from ..measures.tiled import refusal

        problem = refusal(
            not args.no_maps,
            names,
            torch.float64 if args.compute_dtype == "float64" else torch.float32,
            args.device or "cpu",
        )
        if problem is not None:
            raise InputError(problem)
    if args.heads is not None and (args.no_maps or args.no_figures):
        why = "--no-maps keeps no maps" if args.no_maps else "--no-figures draws none"
        raise InputError(f"--heads chooses the heatmap figure's heads, and {why}: drop --heads")
    dims = peek_dims(args.model)  # the config alone; None: checked right after loading
    if dims is not None:
        resolve_layers(args.layers, dims.num_layers)  # a bad --layers fails here too
        args.heads = check_heads(args.heads, dims.num_layers, dims.num_heads, args.layers)
    options = TraceOptions(
        measures=args.measures,
        layers=args.layers,
        max_tokens=args.max_tokens,
        truncate=args.truncate,
        compute_dtype=args.compute_dtype,
        maps=not args.no_maps,
        storage_dtype=args.storage_dtype,
        top_k=args.top_k,
        memory_limit=args.memory_limit,
        exact_inputs=args.exact_inputs,
        kernels=args.kernels,
        kernel_precision=args.kernel_precision,
    )
    from ..tracing.folder import writer_lock

    # one writer per folder: a second `cw trace --out` into it is refused before the model
    # loads; held across the trace and its figures
    with writer_lock(args.out):
        return _trace(args, text, options)


def _trace(args: argparse.Namespace, text: str, options: TraceOptions) -> int:
    from ..loading import load_model
    from ..tracing import trace

    model = load_model(args.model, dtype=args.dtype, device=args.device)
    args.heads = check_heads(args.heads, model.num_layers, model.num_heads, args.layers)
    start = time.perf_counter()
    result = trace(model, text, out=args.out, overwrite=args.overwrite, **options.as_kwargs())
    elapsed = time.perf_counter() - start
    out = Path(args.out)
    if not args.no_figures:
        from ..presentation import figures

        if result.has_maps:
            figures.save(figures.plot_heatmaps(result, args.heads), out / "heatmaps.png")
        if any(m in result.measures for m in figures.FIRST_TOKEN_MEASURES):
            figures.save(figures.plot_first_token_weight(result), out / "first_token_weight.png")
    print(
        f"{model.name}: {plural(result.num_tokens, 'token')}, "
        f"{plural(len(result.layers), 'layer')} x {plural(result.num_heads, 'head')}, "
        f"{plural(len(result.measures), 'measure')} in {elapsed:.1f} s"
        + ("" if result.has_maps else " (no maps: reductions only)")
    )
    summary = result.summary()
    if not summary.empty:
        print(summary.to_string(float_format=lambda v: f"{v:.3f}"))
    if "attention" in result.measures:
        from .show_cmd import format_sinks

        print(format_sinks(result.sinks()))
    from ..tracing.format import trace_files

    # read from the folder (the trace emptied it of an earlier trace's files first), so
    # the list is what this trace wrote
    print(f"wrote {', '.join(trace_files(out))} to {out}")
    print(f"a query's top tokens: cw show {out} --layer {result.layers[-1]} --query -1")
    return 0
