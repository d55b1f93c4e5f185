"""Pure tensor maths: the per-layer measures (method §2) and their aggregates (method §3)."""

from .aggregates import entropy, first_token_weight, normalised, token_scores
from .layer import LayerTensors, LayerVectors, safe_div, split_output_weight
from .registry import (
    MEASURES,
    AbsoluteOf,
    Measure,
    RankOne,
    Recipe,
    RowScaled,
    Style,
    compute_measures,
    get_measure,
    measure_names,
    register_measure,
    resolve_measures,
)

__all__ = [
    "MEASURES",
    "AbsoluteOf",
    "LayerTensors",
    "LayerVectors",
    "Measure",
    "RankOne",
    "Recipe",
    "RowScaled",
    "Style",
    "compute_measures",
    "entropy",
    "first_token_weight",
    "get_measure",
    "measure_names",
    "normalised",
    "register_measure",
    "resolve_measures",
    "safe_div",
    "split_output_weight",
    "token_scores",
]
