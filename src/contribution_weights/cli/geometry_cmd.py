"""``cw geometry``: value geometry and attention sinks (paper §6, appendix D) for any model."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..experiments.geometry import ANALYSES, DEFAULT_GAMMAS
from .common import (
    add_corpus_arguments,
    add_model_arguments,
    check_out_dir,
    load_corpus,
    parse_floats,
    parse_int_list,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "geometry",
        help="value geometry and sinks: component regressions, first-token weight, entropy, "
        "sink alignment/scaling, norm fit, semantic cone (tables.json, tables.md, figures)",
    )
    add_corpus_arguments(p)
    p.add_argument(
        "--max-tokens", type=int, default=256, help="cut texts to N tokens (default 256)"
    )
    p.add_argument(
        "--only", default=None, help=f"comma-separated analyses (default all: {','.join(ANALYSES)})"
    )
    p.add_argument(
        "--cap", type=int, default=5_000_000, help="sampled regression points (default 5e6)"
    )
    p.add_argument(
        "--gammas",
        type=parse_floats,
        default=list(DEFAULT_GAMMAS),
        help=f"sink-value scales (default {','.join(map(str, DEFAULT_GAMMAS))})",
    )
    p.add_argument(
        "--sink-layers",
        type=parse_int_list,
        default=None,
        help="layers to scale v_0 in, e.g. 2-29 (default: detected, mean α_i0 > --sink-threshold)",
    )
    p.add_argument(
        "--sink-threshold", type=float, default=0.5, help="sink-layer detection threshold"
    )
    p.add_argument("--seed", type=int, default=0, help="sampling and fold seed")
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--resume", action="store_true", help="continue (or re-render) the run in --out")
    add_model_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..experiments.geometry import GeometryOptions, resolve_analyses
    from ..experiments.geometry_run import run_geometry
    from ..loading import load_model
    from ..presentation.geometry_plots import write_figures, write_markdown

    check_out_dir(args.out)  # before the data and the model load
    analyses = resolve_analyses(args.only)
    if args.max_tokens is not None and args.max_tokens < 2:
        raise ValueError(f"--max-tokens must be at least 2, not {args.max_tokens}")
    if any(not 0 <= g <= 1 for g in args.gammas):
        raise ValueError(f"--gammas must lie in [0, 1], got {args.gammas}")
    texts, source = load_corpus(args)
    options = GeometryOptions(
        max_tokens=args.max_tokens,
        cap=args.cap,
        seed=args.seed,
        gammas=args.gammas,
        sink_layers=args.sink_layers,
        sink_threshold=args.sink_threshold,
    )
    model = load_model(args.model, dtype=args.dtype, device=args.device)
    result = run_geometry(
        model, texts, args.out, analyses, options, resume=args.resume, source=source
    )
    title = f"{model.name} on {source} ({result.sequences} texts, ≤{args.max_tokens} tokens)"
    md = write_markdown(result, args.out / "tables.md", title)
    figures = write_figures(result, args.out, title=model.name)
    print(md)
    print(f"wrote {args.out}/tables.json, tables.md, per_layer.csv and {len(figures)} figures")
    return 0
