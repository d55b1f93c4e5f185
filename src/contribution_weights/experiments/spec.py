"""Experiments registered by name: what ``cw <experiment>`` needs of each, declared once.

An :class:`ExperimentSpec` names the experiment's options class, its entry point (a
``"module:function"`` path, imported only when the command runs, so that ``cw --help``
stays light), the inputs it reads, and the file its figure goes to. The command line
generates ``cw <name>`` from every registered spec (``cli/experiment_cmd.py``): the
corpus arguments, one flag per option, the run-folder and model arguments; it runs the
experiment, prints its summary and writes its figure (registered by result type in the
presentation layer). A new experiment is one module (options, :class:`~.runner.Experiment`,
result, entry point, and a :func:`register_experiment` call) plus its figure.

Pure Python: importing this module imports nothing heavy.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..registry import Registry
from .attribution_eval.options import AttributionEvalOptions
from .options import (
    DownstreamOptions,
    FaithfulnessOptions,
    KVEvalOptions,
    Options,
)

#: what an experiment reads: ``corpus``, texts (--dataset | --texts | --file);
#: ``task_items``, the items of a multiple-choice task (--task, --data-dir | --items);
#: ``kv``, texts for language modelling, none for passkey, FineWeb-Edu from --data-dir for
#: ruler (--dataset | --texts | --task);
#: ``attribution``, texts for deletion or none for the generated tasks (--dataset | --texts |
#: --task);
#: ``none``, nothing
INPUTS = ("corpus", "task_items", "kv", "attribution", "none")


@dataclass(frozen=True)
class ExperimentSpec:
    """How ``cw <name>`` runs an experiment.

    Attributes:
        name: the command.
        help: one line for ``cw --help``.
        options: the options dataclass (an :class:`~.options.Options`): its flagged fields
            become the command's flags.
        run: the entry point, ``run(model, inputs, *, options, out, resume, source, ...)``
            returning an :class:`~.result.ExperimentResult`: a callable, or a
            ``"module:function"`` path imported when the command runs.
        inputs: one of :data:`INPUTS`.
        batch_size: the entry point takes ``batch_size`` (the command adds ``--batch-size``).
        figure: the file name of the figure in the run folder, or a function of the result
            giving it (None: no figure).
        digits: significant digits of the printed summary.
        notes: a function of the result giving lines to print after the summary (e.g. that
            the texts ran out), or a ``"module:function"`` path to one.
        result: the result type, or a ``"module:Class"`` path to it: its ``load(folder)``
            reads a run folder back and its ``write_summary(folder)`` writes every file the
            run derives from its rows, which ``cw results`` rebuilds (None: not rebuilt).
    """

    name: str
    help: str
    options: type[Options]
    run: str | Callable[..., Any]
    inputs: str = "corpus"
    batch_size: bool = False
    figure: str | Callable[[Any], str | None] | None = None
    digits: int = 4
    notes: str | Callable[[Any], list[str]] | None = None
    result: str | type | None = None

    def __post_init__(self) -> None:
        if self.inputs not in INPUTS:
            raise ValueError(f"inputs must be one of {', '.join(INPUTS)}, not {self.inputs!r}")

    def entry_point(self) -> Callable[..., Any]:
        """The run function (imported now if given as a path)."""
        return _resolve(self.run)

    def result_type(self) -> Any:
        """The result type (imported now if given as a path), or None."""
        return None if self.result is None else _resolve(self.result)

    def figure_name(self, result: Any) -> str | None:
        return self.figure(result) if callable(self.figure) else self.figure

    def notes_of(self, result: Any) -> list[str]:
        return [] if self.notes is None else list(_resolve(self.notes)(result))


def _resolve(target: str | Callable[..., Any]) -> Callable[..., Any]:
    if callable(target):
        return target
    module, _, name = target.partition(":")
    value: Callable[..., Any] = getattr(importlib.import_module(module), name)
    return value


EXPERIMENTS: Registry[ExperimentSpec] = Registry("experiment")


def register_experiment(spec: ExperimentSpec) -> ExperimentSpec:
    """Add (or replace) an experiment; ``cw <name>`` is generated from it."""
    return EXPERIMENTS.register(spec)


register_experiment(
    ExperimentSpec(
        "faithfulness",
        "comprehensiveness/sufficiency: ΔPPL when the top/bottom tokens of each measure "
        "are removed",
        FaithfulnessOptions,
        "contribution_weights.experiments.faithfulness:faithfulness",
        batch_size=True,
        figure="faithfulness.png",
        result="contribution_weights.experiments.faithfulness:FaithfulnessResult",
    )
)

register_experiment(
    ExperimentSpec(
        "downstream",
        "accuracy on MMLU/WinoGrande/BoolQ when only the top prompt tokens of each "
        "measure are kept (sufficiency)",
        DownstreamOptions,
        "contribution_weights.experiments.downstream:downstream",
        inputs="task_items",
        batch_size=True,
        figure="downstream.png",
        digits=3,
        result="contribution_weights.experiments.downstream:DownstreamResult",
    )
)
register_experiment(
    ExperimentSpec(
        "kv-eval",
        "compress the KV cache after a prefill by each method and ratio; NLL of the next "
        "128 tokens (lm), passkey accuracy, or RULER-like long-context accuracy (ruler)",
        KVEvalOptions,
        "contribution_weights.experiments.kv_eval:kv_eval",
        inputs="kv",
        figure=lambda result: f"kv-{'nll' if result.config['task'] == 'lm' else 'accuracy'}.png",
        notes="contribution_weights.experiments.kv_eval:shortfall",
        result="contribution_weights.experiments.kv_eval:KVEvalResult",
    )
)

register_experiment(
    ExperimentSpec(
        "attribution-eval",
        "end-to-end attributions against known answers (induction, lookup, passkey) and by "
        "deletion/insertion of the top tokens",
        AttributionEvalOptions,
        "contribution_weights.experiments.attribution_eval:attribution_eval",
        inputs="attribution",
        batch_size=True,
        figure="attribution-eval.png",
        digits=3,
        result="contribution_weights.experiments.attribution_eval:AttributionEvalResult",
    )
)
__all__ = ["EXPERIMENTS", "INPUTS", "ExperimentSpec", "register_experiment"]
