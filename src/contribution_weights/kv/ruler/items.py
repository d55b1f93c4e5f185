"""One item of a RULER-like task, :class:`RulerItem`, and the checks of a task's and a
setting's name (see :mod:`~..ruler`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ...defaults import RULER_SETTINGS, RULER_TASKS


class RulerError(ValueError):
    """An item cannot be made as asked (length too short, haystack too small, …)."""


@dataclass(frozen=True)
class RulerItem:
    """One item: ``context`` + ``question`` + ``answer_prefix`` is the whole prompt.

    Attributes:
        task: one of :data:`~..defaults.RULER_TASKS`.
        context: ``(1, c)`` ids: chat start, instruction, haystack with the needles.
        question: ``(1, q)`` ids: prefilled in ``query_aware``, fed after in ``query_agnostic``.
        answer_prefix: ``(1, a)`` ids: the chat template's assistant turn and the start of
            the answer; always fed after compression.
        answers: the strings a correct answer contains.
        max_new_tokens: tokens generated after the answer prefix.
        meta: how the item was made: ``depths`` of the needles, ``depth`` of the (first)
            asked needle, keys, values, the counts of cwe and fwe, ``seed``.
    """

    task: str
    context: Tensor
    question: Tensor
    answer_prefix: Tensor
    answers: tuple[str, ...]
    max_new_tokens: int
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return int(self.context.shape[1] + self.question.shape[1] + self.answer_prefix.shape[1])

    def prompt(self) -> Tensor:
        """``(1, length)``: the whole prompt."""
        return torch.cat([self.context, self.question, self.answer_prefix], dim=1)

    def prefill_ids(self, setting: str) -> Tensor:
        """What is prefilled and compressed in ``setting``."""
        check_setting(setting)
        if setting == "query_aware":
            return torch.cat([self.context, self.question], dim=1)
        return self.context

    def fed_ids(self, setting: str) -> Tensor:
        """What is fed on the compressed cache before generating, in ``setting``."""
        check_setting(setting)
        if setting == "query_aware":
            return self.answer_prefix
        return torch.cat([self.question, self.answer_prefix], dim=1)


def check_setting(setting: str) -> str:
    if setting not in RULER_SETTINGS:
        raise ValueError(f"unknown setting {setting!r}; choose from {', '.join(RULER_SETTINGS)}")
    return setting


def check_task(task: str) -> str:
    if task not in RULER_TASKS:
        raise ValueError(f"unknown RULER task {task!r}; choose from {', '.join(RULER_TASKS)}")
    return task
