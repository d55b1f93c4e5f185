"""Measures registered by name.

The Python API, the CLI's choices and the experiments all read this one registry, so a
new measure is one function plus one :func:`register_measure` call.

Each :class:`Measure` maps a :class:`~.layer.LayerTensors` to a ``(B, H, I, T)`` tensor
and says how to normalise it so that, per query, the weights sum to one over heads and
keys (method §3); measures that are not weights (the relative norm and the cosine) have no
normalisation and are left out of weight summaries.
"""

# ruff: noqa: F722  (jaxtyping shape strings are not forward references)

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from jaxtyping import Float
from torch import Tensor

from . import layer
from .layer import LayerTensors, safe_div


def _per_query_sum(w: Float[Tensor, "*lead h i t"]) -> Float[Tensor, "*lead h i t"]:
    """Divide ``(..., H, T, T)`` by its sum over heads and keys, per query."""
    return safe_div(w, w.sum(dim=(-3, -1), keepdim=True))


def _divide_by_heads(w: Float[Tensor, "*lead h i t"]) -> Float[Tensor, "*lead h i t"]:
    return w / w.shape[-3]


def _as_is(w: Float[Tensor, "*lead h i t"]) -> Float[Tensor, "*lead h i t"]:
    return w


@dataclass(frozen=True)
class Measure:
    """A per-layer, per-head, query × key quantity.

    Attributes:
        name: registry key, used by the API, the CLI and in saved files.
        compute: ``LayerTensors -> (B, H, I, T)``.
        description: one line for ``cw measures`` and the docs.
        normalise: ``(…, H, T, T) -> same`` scaling each query's weights to sum 1 over
            (head, key), or None for quantities that are not weights.
        signed: values may be negative (draw with a diverging colour scale).
    """

    name: str
    compute: Callable[[LayerTensors], Tensor]
    description: str
    normalise: Callable[[Tensor], Tensor] | None = None
    signed: bool = False

    @property
    def is_weight(self) -> bool:
        return self.normalise is not None


_MEASURES: dict[str, Measure] = {}


def register_measure(measure: Measure) -> Measure:
    """Add (or replace) a measure; it becomes available everywhere by its name."""
    _MEASURES[measure.name] = measure
    return measure


def get_measure(name: str) -> Measure:
    try:
        return _MEASURES[name]
    except KeyError:
        raise ValueError(
            f"unknown measure {name!r}; valid measures: {', '.join(measure_names())}"
        ) from None


def measure_names() -> list[str]:
    return list(_MEASURES)


def resolve_measures(measures: str | Iterable[str] | None) -> list[str]:
    """``"all"``, one name, a comma-separated string or a list, checked and deduplicated."""
    if measures is None or measures == "all":
        return [m for m in measure_names() if m != "ihc"]
    if isinstance(measures, str):
        measures = [m.strip() for m in measures.split(",") if m.strip()]
    names: list[str] = []
    for name in measures:
        get_measure(name)
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError(f"no measure named; valid measures: {', '.join(measure_names())}")
    return names


for _m in (
    Measure("attention", layer.attention, "attention probability α", _divide_by_heads),
    Measure(
        "contribution",
        layer.contribution,
        "inter-head contribution ĉ = ⟨o_i, α ṽ_j⟩/‖o_i‖²",
        _as_is,
        signed=True,
    ),
    Measure(
        "intra",
        layer.intra,
        "intra-head contribution č = ⟨o_i^h, α ṽ_j⟩/‖o_i^h‖²",
        _divide_by_heads,
        signed=True,
    ),
    Measure("relative_norm", layer.relative_norm, "relative norm r = ‖ṽ_j‖/‖o_i‖"),
    Measure("cosine", layer.cosine, "cosine κ = cos(o_i, ṽ_j)", signed=True),
    Measure("vw", layer.vw, "value-weighted attention α‖ṽ_j‖", _per_query_sum),
    Measure("vw_on", layer.vw_on, "output-normalised value-weighted α‖ṽ_j‖/‖o_i‖", _per_query_sum),
    Measure("distance", layer.distance, "distance-based (Ferrando et al. 2022)", _as_is),
    Measure("ihc", layer.ihc, "|ĉ|, the importance used for faithfulness", _per_query_sum),
):
    register_measure(_m)


def compute_measures(lt: LayerTensors, names: Sequence[str]) -> dict[str, Tensor]:
    return {name: get_measure(name).compute(lt) for name in names}


__all__ = [
    "Measure",
    "compute_measures",
    "get_measure",
    "measure_names",
    "register_measure",
    "resolve_measures",
]
