"""Pure tensor maths: the per-layer measures (method §2) and their aggregates (method §3)."""

from . import registry
from .aggregates import entropy, first_token_weight, normalised, token_scores
from .layer import LayerTensors, LayerVectors, safe_div, split_output_weight
from .registry import *  # noqa: F403  (the registry's public names: its __all__)

__all__ = [  # the registry's public names, and the tensor maths around them
    *registry.__all__,
    "LayerTensors",
    "LayerVectors",
    "entropy",
    "first_token_weight",
    "normalised",
    "safe_div",
    "split_output_weight",
    "token_scores",
]
