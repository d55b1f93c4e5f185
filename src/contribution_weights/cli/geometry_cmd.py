"""``cw geometry``: value geometry and attention sinks (paper §6, appendix D) for any model."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..experiments.options import GeometryOptions
from .common import (
    add_corpus_arguments,
    add_model_arguments,
    check_out_dir,
    check_run_folder,
    fit_corpus,
    load_corpus,
    model_device,
    print_written,
)
from .options import add_options, options_from_args, resumed_options


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "geometry",
        help="value geometry and sinks: component regressions, first-token weight, entropy, "
        "sink alignment/scaling, norm fit, semantic cone (tables.json, tables.md, figures)",
    )
    add_corpus_arguments(p)
    p.add_argument(
        "--only",
        default=None,
        help="comma-separated analyses (default all; docs/geometry.md describes them, and an "
        "unknown name is answered with the list)",
    )
    add_options(p, GeometryOptions)
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue (or re-render) the run in --out (options not given keep the run's values)",
    )
    add_model_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..data import MissingDataError
    from ..experiments.geometry import resolve_analyses, run_geometry
    from ..experiments.result import few_samples_on_stderr
    from ..experiments.runner import processes
    from ..loading import load_model
    from ..presentation.geometry_plots import write_figures, write_markdown
    from .experiment_cmd import MORE_TEXTS

    check_out_dir(args.out)  # before the data and the model load
    check_run_folder(args.out, args.resume)
    analyses = resolve_analyses(args.only)
    kept = resumed_options(GeometryOptions, args, {}, "geometry")
    options = options_from_args(GeometryOptions, args, **kept)  # bad options fail before loading
    try:
        texts, source = load_corpus(args)
    except MissingDataError as err:
        raise err.for_command("geometry", "--texts FILE.jsonl or --file FILE.txt") from None
    model = load_model(args.model, dtype=args.dtype, device=model_device(args))
    texts, source = fit_corpus(args, model, texts, source)
    with few_samples_on_stderr("geometry", MORE_TEXTS):
        result = run_geometry(
            model, texts, args.out, analyses, options, resume=args.resume, source=source
        )
    if not processes().main:
        return 0
    title = f"{model.name} on {source} ({result.sequences} texts, ≤{options.max_tokens} tokens)"
    md = write_markdown(result, args.out / "tables.md", title)
    write_figures(result, args.out, title=model.name)
    print(md)
    print_written(args.out)
    return 0
