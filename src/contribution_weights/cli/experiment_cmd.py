"""``cw <experiment>`` generated from a registered :class:`~..experiments.spec.ExperimentSpec`.

Every experiment command is the same steps: check ``--out``, build the options (bad values
fail before anything loads), read the inputs, load the model, run (resumable, data
parallel under ``accelerate launch``), print the summary and the skipped units, draw the
figure, and list the files written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..defaults import ATTRIBUTION_TASKS, KV_TASKS
from ..experiments.spec import ExperimentSpec
from .common import (
    add_corpus_arguments,
    add_model_arguments,
    check_out_dir,
    check_run_folder,
    fit_corpus,
    load_corpus,
    model_device,
    positive_int,
    print_written,
)
from .options import add_options, options_from_args, resumed_options

#: the most texts a generated task's haystack reads (the data set may be a hub stream)
HAYSTACK_TEXTS = 1000
#: how to give a corpus experiment more than one text (the hint after a warning)
MORE_TEXTS = (
    "--dataset with --n 2 or more, or a --texts/--file holding 2 or more texts; a .txt "
    "file holds one text per block of lines separated by a blank line"
)


def add_run_arguments(
    p: argparse.ArgumentParser,
    batch_size: bool = True,
    resume: str = "continue the run in --out (options not given keep the run's values)",
) -> None:
    """--out, --resume (help ``resume``), (--batch-size) and the model arguments of an
    experiment."""
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--resume", action="store_true", help=resume)
    if batch_size:
        p.add_argument(
            "--batch-size", type=positive_int, default=None, help="rows per forward (default: auto)"
        )
    add_model_arguments(p)


def run_options(
    args: argparse.Namespace, name: str, options_type: type, fixed: dict[str, Any]
) -> Any:
    """The options of the run in ``--out``, checked before anything loads: the folder can
    be written and holds this run (or none), options not given keep a resumed run's values
    and ``fixed`` are set by the command itself; bad values fail here."""
    check_out_dir(args.out)  # before the data and the model load
    check_run_folder(args.out, args.resume)
    kept = resumed_options(options_type, args, fixed, name)
    return options_from_args(options_type, args, **kept, **fixed)


def keep_held_model(args: argparse.Namespace, held: dict[str, Any] | None) -> None:
    """With --resume on a folder holding a run (``held``, its config) and no --model: the
    run's model."""
    if held and args.model is None and isinstance(held.get("model"), str):
        args.model = held["model"]


def load_inputs(
    args: argparse.Namespace, name: str, inputs: Any
) -> tuple[Any, Any, str, dict[str, Any]]:
    """The model and what ``cw NAME`` reads (its spec's ``inputs``), fitted to the model,
    with their source and the entry point's extra arguments; a data set that is not
    there is an error naming the command's own way to give inputs."""
    from ..data import MissingDataError
    from ..loading import load_model

    try:
        data, source, extra = inputs.read(args)
    except MissingDataError as err:
        raise err.for_command(name, inputs.own) from None
    model = load_model(args.model, dtype=args.dtype, device=model_device(args))
    data, source = inputs.fit(args, model, data, source)
    return model, data, source, extra


def print_skipped(result: object) -> None:
    skipped = getattr(result, "skipped", [])
    if skipped:
        reasons = sorted({s["reason"] for s in skipped})
        print(f"skipped {len(skipped)} units ({'; '.join(reasons)}); see run_info.json")


# ---- what an experiment reads, by its spec's input kind -----------------------------------
class Corpus:
    """Texts: --dataset NAME | --texts FILE.jsonl | --file FILE.txt, --n, --min-tokens, --join."""

    own = "--texts FILE.jsonl or --file FILE.txt"
    more = MORE_TEXTS

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        add_corpus_arguments(p)

    def read(self, args: argparse.Namespace) -> tuple[Any, str, dict[str, Any]]:
        texts, source = load_corpus(args)
        return texts, source, {}

    def fit(self, args: argparse.Namespace, model: Any, texts: Any, source: str) -> Any:
        return fit_corpus(args, model, texts, source)


class TaskItems:
    """Items of a multiple-choice task: --task, --n, and --data-dir | --items FILE.jsonl."""

    own = "--items FILE.jsonl (one item per line; --help lists the fields)"
    more = "--n 2 or more"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        from ..data import TASKS

        p.add_argument("--task", choices=TASKS, required=True)
        p.add_argument("--n", type=positive_int, default=None, help="use the first N items")
        src = p.add_mutually_exclusive_group()
        src.add_argument(
            "--data-dir",
            type=Path,
            default=None,
            help="data folder (else $CW_DATA_DIR, else the hub)",
        )
        src.add_argument(
            "--items",
            type=Path,
            default=None,
            metavar="FILE.jsonl",
            help="your own items instead of the task's data, one JSON object per line with the "
            "task's fields: mmlu: question, choices (a list of 4), answer (0-3), subject "
            "(optional); winogrande: sentence (one _ blank), option1, option2, answer (1 or 2); "
            "boolq: question, passage, label (true/false); any task: prompt, options (a list), "
            "answer (0-based index of the right option)",
        )

    def read(self, args: argparse.Namespace) -> tuple[Any, str, dict[str, Any]]:
        from ..data import load_task, read_items

        if args.items is not None:
            items, source = read_items(args.items, args.task, args.n), str(args.items)
        else:
            items, source = load_task(args.task, args.n, args.data_dir), args.task
        return items, source, {"task": args.task}

    def fit(self, args: argparse.Namespace, model: Any, items: Any, source: str) -> Any:
        return items, source


class TextsOrTask:
    """Texts (--dataset | --texts) for the task that reads them, or none for a task whose
    items are generated (--task): kv-eval's lm and passkey, attribution-eval's deletion
    and known-answer tasks. A generated task in ``haystack`` reads that data set from
    --data-dir (kv-eval's ruler: FineWeb-Edu, the haystack of its needles)."""

    def __init__(
        self,
        tasks: tuple[str, ...],
        text_task: str,
        what: str,
        more: str,
        haystack: dict[str, str] | None = None,
    ) -> None:
        self.tasks, self.text_task, self.what = tasks, text_task, what
        self.haystack = haystack or {}
        generated = ", ".join(t for t in tasks if t != text_task and t not in self.haystack)
        self.own = f"--texts FILE.jsonl (or --task {generated}, which needs no data)"
        self.more = more

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        from ..data import TEXT_DATASETS

        src = p.add_mutually_exclusive_group()  # one is needed, but --resume keeps the run's
        src.add_argument("--dataset", choices=TEXT_DATASETS, help=f"texts for {self.what}")
        src.add_argument(
            "--texts", type=Path, help=f"a .jsonl file of texts (field: --field) for {self.what}"
        )
        needs = f"all but {self.text_task} need no data"
        if self.haystack:
            reads = "; ".join(f"{t} reads {d} from --data-dir" for t, d in self.haystack.items())
            needs = f"{self.text_task} reads --dataset or --texts; {reads}; the others need none"
        src.add_argument("--task", choices=self.tasks, help=f"{' or '.join(self.tasks)} ({needs})")
        p.add_argument(
            "--field", default="text", help="JSONL field holding the text (default text)"
        )
        p.add_argument(
            "--data-dir", type=Path, default=None, help="data folder (else $CW_DATA_DIR)"
        )

    def resolve(self, args: argparse.Namespace, held: dict[str, Any] | None) -> str | None:
        """Where the command line gives no inputs: a resumed run's (``held``, its config)
        generated task (one that reads no texts) as ``args.task``, so that ``--resume
        --out DIR`` alone continues it; else what is missing (None: nothing is)."""
        if args.dataset or args.texts or args.task:
            return None
        task = (held or {}).get("task")
        if task in self.tasks and task != self.text_task:
            args.task = task
            return None
        if held is not None:
            return (
                f"{args.out} holds a run of --task {task or self.text_task}, which reads "
                "texts: give its --dataset NAME or --texts FILE.jsonl again"
            )
        return "one of the arguments --dataset --texts --task is required"

    def read(self, args: argparse.Namespace) -> tuple[Any, str, dict[str, Any]]:
        from .. import data

        task = args.task or self.text_task
        if task in self.haystack:
            name = self.haystack[task]
            return data.load_texts(name, HAYSTACK_TEXTS, args.data_dir), f"{task}:{name}", {}
        if task != self.text_task:
            return None, task, {}
        if args.dataset:
            return data.load_texts(args.dataset, None, args.data_dir), args.dataset, {}
        if args.texts:
            return data.read_texts(args.texts, field=args.field), str(args.texts), {}
        raise ValueError(
            f"--task {self.text_task} needs texts: use --dataset NAME or --texts FILE.jsonl"
        )

    def options(self, args: argparse.Namespace) -> dict[str, Any]:
        return {"task": args.task or self.text_task}

    def fit(self, args: argparse.Namespace, model: Any, texts: Any, source: str) -> Any:
        return texts, source


class NoInputs:
    own = ""
    more = ""

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        pass

    def read(self, args: argparse.Namespace) -> tuple[Any, str, dict[str, Any]]:
        return None, "", {}

    def fit(self, args: argparse.Namespace, model: Any, inputs: Any, source: str) -> Any:
        return inputs, source


INPUTS: dict[str, Any] = {
    "corpus": Corpus(),
    "task_items": TaskItems(),
    "kv": TextsOrTask(
        KV_TASKS,
        "lm",
        "language modelling",
        "--n 2 or more; the lm task makes an item of every --context-tokens + 129 tokens of "
        "consecutive texts, so give texts enough for 2",
        haystack={"ruler": "fineweb-edu"},
    ),
    "attribution": TextsOrTask(ATTRIBUTION_TASKS, "deletion", "the deletion task", "--n 2 or more"),
    "none": NoInputs(),
}


# ---- the generated command ----------------------------------------------------------------
def register(sub: argparse._SubParsersAction, spec: ExperimentSpec) -> None:
    p = sub.add_parser(
        spec.name,
        help=spec.help,
        description=f"{spec.help[:1].upper()}{spec.help[1:]}. Results go to a run folder "
        "(--out: config.json, the rows as each unit finishes, the summary, run_info.json and "
        "a figure); --resume continues an interrupted run.",
    )
    INPUTS[spec.inputs].add_arguments(p)
    add_options(p, spec.options)
    add_run_arguments(p, batch_size=spec.batch_size)
    p.set_defaults(func=lambda args: run(args, spec))


def run(args: argparse.Namespace, spec: ExperimentSpec) -> int:
    from ..experiments.result import few_samples_on_stderr
    from ..experiments.runner import processes
    from ..presentation.figures import figure_for, plot
    from ..runs import RunFolder

    inputs = INPUTS[spec.inputs]
    held = RunFolder.held_config(args.out) if args.resume else None
    keep_held_model(args, held)
    missing = inputs.resolve(args, held) if hasattr(inputs, "resolve") else None
    if missing:
        print(f"cw {spec.name}: error: {missing}", file=sys.stderr)
        return 2
    fixed = inputs.options(args) if hasattr(inputs, "options") else {}
    options = run_options(args, spec.name, spec.options, fixed)
    entry = spec.entry_point()  # a plugin's bad entry point fails before the model loads
    model, data, source, extra = load_inputs(args, spec.name, inputs)
    if spec.batch_size:
        extra["batch_size"] = args.batch_size
    with few_samples_on_stderr(
        spec.name, MORE_TEXTS if spec.inputs == "corpus" else "--n 2 or more"
    ):
        result = entry(
            model, data, options=options, out=args.out, resume=args.resume, source=source, **extra
        )
    if not processes().main:
        return 0
    summary = getattr(result, "summary", None)
    empty = summary is not None and getattr(summary, "empty", False)
    if summary is not None and not empty:
        digits = spec.digits
        print(summary.to_string(index=False, float_format=lambda x: f"{x:.{digits}g}"))
    for line in spec.notes_of(result):
        print(line)
    print_skipped(result)
    figure = spec.figure_name(result)
    if figure and not empty and figure_for(result) is not None:
        plot(result, args.out / figure)
    print_written(args.out)
    if empty:  # every unit skipped: a run with no result is not a success
        print(
            f"cw {spec.name}: error: no result: no unit could run (the reasons are above and "
            "in run_info.json); give other inputs",
            file=sys.stderr,
        )
        return 1
    return 0
