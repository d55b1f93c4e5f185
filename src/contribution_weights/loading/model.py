"""What a load gives: a :class:`LoadedModel` (model, tokenizer, the sizes read from its
configuration), or a :class:`ModelLoadError` that says why not."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..families import FamilySpec, family_for


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message says why and what to do."""


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer, ready for :func:`contribution_weights.trace`."""

    model: Any  # transformers.PreTrainedModel
    tokenizer: Any  # transformers.PreTrainedTokenizerBase
    name: str

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def family(self) -> FamilySpec:
        return family_for(self.model.config)

    @property
    def text_config(self) -> Any:
        return getattr(self.config, "text_config", None) or self.config

    @property
    def num_layers(self) -> int:
        return int(self.text_config.num_hidden_layers)

    @property
    def num_heads(self) -> int:
        return int(self.text_config.num_attention_heads)

    @property
    def max_positions(self) -> int | None:
        value = getattr(self.text_config, "max_position_embeddings", None)
        return int(value) if value else None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def last_logits_only(self) -> dict[str, Any]:
        """Forward keyword arguments that ask for the last position's logits only
        (``logits_to_keep=1``), where the model's forward accepts them; else none."""
        import inspect

        params = inspect.signature(self.model.forward).parameters
        return {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    def __repr__(self) -> str:
        return (
            f"LoadedModel({self.name!r}, {self.config.model_type}, {self.num_layers} layers, "
            f"{self.num_heads} heads, {self.model.dtype})"
        )
