"""``cw attribute``: which input tokens drove a prediction, by one or several methods."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..attribution.methods import METHODS
from ..attribution.options import AttributeOptions
from .common import (
    add_command,
    add_model_arguments,
    add_text_arguments,
    check_out_dir,
    positive_int,
    read_text,
)
from .options import add_options, options_from_args

#: the command's line in ``cw --help``, and the text atop its own ``--help``
HELP = "which input tokens drove a prediction (contribution flow, baselines)"
DESCRIPTION = """Attribute the model's prediction at a position (default: the last) to the input
tokens: contribution flow composes every layer's contributions with the residual stream and
projects them on the target; other methods for comparison."""


def _methods_help() -> str:
    own = [f"{m.name}: {m.description} ({m.cost})" for m in METHODS if not m.absolute_of]
    twins = [m.name for m in METHODS if m.absolute_of]
    if twins:
        own.append(f"{', '.join(twins)}: the magnitudes of the signed methods' scores")
    return "; ".join(own)


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "attribute", run, HELP, f"{DESCRIPTION} Methods: {_methods_help()}.")
    add_text_arguments(p)
    add_model_arguments(p)
    add_options(p, AttributeOptions)
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for attribution.json, routes.json, figures and an HTML view",
    )
    p.add_argument(
        "--top", type=positive_int, default=8, help="tokens listed per method (default 8)"
    )


def run(args: argparse.Namespace) -> int:
    options = options_from_args(AttributeOptions, args)  # bad values exit 2 here
    if args.out is not None:
        check_out_dir(args.out)
    text = read_text(args)
    from ..loading import load_model, peek_tokenizer

    tokenizer = peek_tokenizer(args.model)
    if tokenizer is not None:  # a bad target fails before the model loads
        import torch

        from ..attribution.run import prompt_ids, targets_of

        ids = torch.tensor(tokenizer(text, add_special_tokens=True)["input_ids"])
        targets_of(tokenizer, prompt_ids(ids, options), options, vocab_size=len(tokenizer))
    model = load_model(args.model, dtype=args.dtype, device=args.device)
    from ..attribution.run import attribute

    result = attribute(model, text, options)
    print(result.summary(args.top))
    if args.out is not None:
        from ..presentation.attribution_html import write_attribution_html
        from ..presentation.attribution_plots import attribution_figure, routes_figure
        from ..presentation.figures import save
        from .common import print_written

        out = Path(args.out)
        written = result.save(out)
        written.append(save(attribution_figure(result), out / "attribution.png"))
        if result.routes is not None:
            written.append(save(routes_figure(result), out / "routes.png"))
        else:  # an earlier attribution's routes figure would describe another text
            (out / "routes.png").unlink(missing_ok=True)
        written.append(write_attribution_html(result, out / "attribution.html"))
        print_written(out, written)
    return 0
