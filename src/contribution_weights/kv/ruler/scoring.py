"""Scoring the RULER-like items: greedy generation on compressed caches after the
setting's fed ids, and RULER's ``string_match_all``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...loading import LoadedModel
from ..cache import CompressedCache, stack_caches
from .haystack import _decode
from .items import RulerItem


def string_match_all(output: str, answers: Sequence[str]) -> float:
    """RULER's metric: the share of ``answers`` found (case-insensitive) in ``output``."""
    text = output.lower()
    return sum(a.lower() in text for a in answers) / len(answers) if answers else 0.0


def ruler_score(
    model: LoadedModel, cache: CompressedCache, item: RulerItem, setting: str
) -> dict[str, Any]:
    """Greedy generation on the compressed cache after the setting's fed ids; the accuracy
    (:func:`string_match_all`) and the generated text."""
    return ruler_scores(model, [cache], item, setting)[0]


def ruler_scores(
    model: LoadedModel, caches: Sequence[CompressedCache], item: RulerItem, setting: str
) -> list[dict[str, Any]]:
    """:func:`ruler_score` for several compressed caches of one prefill at once: stacked as
    the rows of one batch (:func:`~.cache.stack_caches`), generated together, each row cut
    at its first end-of-sequence token as its own generation would have stopped there."""
    fed = item.fed_ids(setting).to(model.model.device)
    kwargs: dict[str, Any] = {"max_new_tokens": item.max_new_tokens, "do_sample": False}
    config = getattr(model.model, "generation_config", None)
    eos = None if config is None else config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if config is not None and config.pad_token_id is None:
        kwargs["pad_token_id"] = (eos[0] if isinstance(eos, list) else eos) or 0
    stacked = stack_caches(caches)
    with torch.no_grad():
        out = stacked.generate(model.model, fed.expand(len(caches), -1), **kwargs)
    scores = []
    for row in out[:, fed.shape[1] :].tolist():
        end = next((k + 1 for k, token in enumerate(row) if token in stops), len(row))
        output = _decode(model.tokenizer, row[:end]).strip()
        scores.append({"accuracy": string_match_all(output, item.answers), "output": output})
    return scores
