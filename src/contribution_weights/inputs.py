"""Input handling shared by tracing and the experiments: texts or ids to checked token ids,
layer indices to model layers, ids to token strings.

Everything here sits below :mod:`.tracing` and :mod:`.experiments`; it knows the loaded
model's tokenizer and size, and nothing of capture or measures.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .loading import LoadedModel


class InputError(ValueError):
    """Bad input to a trace or an experiment: the message says what is wrong and how to fix it."""


def resolve_layers(layers: Sequence[int] | None, num_layers: int) -> list[int]:
    """Model layer indices, sorted and deduplicated; negative indices count from the end."""
    if layers is None:
        return list(range(num_layers))
    out: list[int] = []
    for layer in layers:
        idx = layer + num_layers if layer < 0 else layer
        if not 0 <= idx < num_layers:
            raise InputError(
                f"layer {layer} is out of range: the model has {num_layers} layers "
                f"(valid: 0..{num_layers - 1}, or negative from the end)"
            )
        if idx not in out:
            out.append(idx)
    return sorted(out)


def encode(
    model: LoadedModel, text: str | Sequence[int] | Tensor, max_tokens: int | None, truncate: bool
) -> Tensor:
    """Token ids ``(T,)`` for a text or ids, checked against the length limit."""
    if isinstance(text, str):
        if not text.strip():
            raise InputError("the text is empty; pass some text to trace")
        ids = torch.tensor(model.tokenizer(text, add_special_tokens=True)["input_ids"])
    else:
        ids = torch.as_tensor(text, dtype=torch.long).reshape(-1)
    if ids.numel() == 0:
        raise InputError("no tokens to trace; pass a non-empty text or id list")
    if max_tokens is not None and max_tokens < 1:
        raise InputError(f"max_tokens must be at least 1, not {max_tokens}")
    limit = max_tokens or model.max_positions
    if limit is not None and ids.numel() > limit:
        if not truncate:
            what = "--max-tokens" if max_tokens else "the model's context length"
            raise InputError(
                f"the text has {ids.numel()} tokens, more than {limit} ({what}); "
                "pass truncate=True (CLI: --truncate) to keep the first "
                f"{limit} tokens, or shorten the text"
            )
        ids = ids[:limit]
    return ids


def token_strings(model: LoadedModel, ids: Tensor) -> list[str]:
    return [model.tokenizer.decode([int(i)]) for i in ids]
