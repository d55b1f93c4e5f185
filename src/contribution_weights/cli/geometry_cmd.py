"""``cw geometry``: value geometry and attention sinks (paper §6, appendix D) for any model."""

from __future__ import annotations

import argparse

from ..experiments.options import GeometryOptions
from .common import print_written
from .experiment_cmd import INPUTS, MORE_TEXTS, add_run_arguments, load_inputs, run_options
from .options import add_options


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "geometry",
        help="value geometry and sinks: component regressions, first-token weight, entropy, "
        "sink alignment/scaling, norm fit, semantic cone (tables.json, tables.md, figures)",
    )
    INPUTS["corpus"].add_arguments(p)
    p.add_argument(
        "--only",
        default=None,
        help="comma-separated analyses (default all; docs/geometry.md describes them, and an "
        "unknown name is answered with the list)",
    )
    add_options(p, GeometryOptions)
    add_run_arguments(
        p,
        batch_size=False,
        resume="continue (or re-render) the run in --out (options not given keep the run's values)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..experiments.geometry import resolve_analyses, run_geometry
    from ..experiments.result import few_samples_on_stderr
    from ..experiments.runner import processes
    from ..presentation.geometry_plots import write_figures, write_markdown

    options = run_options(args, "geometry", GeometryOptions, {})  # bad values fail here
    analyses = resolve_analyses(args.only)
    model, texts, source, _ = load_inputs(args, "geometry", INPUTS["corpus"])
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
