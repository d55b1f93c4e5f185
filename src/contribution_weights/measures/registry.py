"""Measures registered by name.

The Python API, the CLI's choices and the experiments all read this one registry, so a
new measure is one function plus one :func:`register_measure` call.

Each :class:`Measure` maps a :class:`~.layer.LayerTensors` to a ``(B, H, I, T)`` tensor
and says how to normalise it so that, per query, the weights sum to one over heads and
keys (method §3); measures that are not weights (the relative norm and the cosine)
have no normalisation and are left out of weight summaries.

Stored and derived measures. Only a few measures need their own ``T × T`` work: the
attention α, the intra-head contribution č, the distance, and either the contribution ĉ
and the cosine κ or the one factor both follow from, p = ⟨o_i, ṽ_j⟩/‖o_i‖² (ĉ = α·p,
κ = p·‖o_i‖/‖ṽ_j‖). The others are cheap functions of a stored map and the per-layer
norms (:class:`~.layer.Factors`): ``vw = α·‖ṽ_j‖``, ``vw_on = α·‖ṽ_j‖/‖o_i‖``,
``relative_norm = ‖ṽ_j‖/‖o_i‖`` (no map at all) and ``ihc = |ĉ|``. A trace keeps the
stored maps (:func:`stored_measures`) and derives the rest when they are read
(``Measure.recipes``), with exactly the arithmetic of ``Measure.compute``, so a derived
map equals the computed one bit for bit.
"""

# ruff: noqa: F722  (jaxtyping shape strings are not forward references)

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

from . import layer
from .layer import Factors, LayerTensors, safe_div


def _per_query_sum(w: Float[Tensor, "*lead h i t"]) -> Float[Tensor, "*lead h i t"]:
    """Divide ``(..., H, T, T)`` by its sum over heads and keys, per query."""
    return safe_div(w, w.sum(dim=(-3, -1), keepdim=True))


def _divide_by_heads(w: Float[Tensor, "*lead h i t"]) -> Float[Tensor, "*lead h i t"]:
    return w / w.shape[-3]


def _as_is(w: Float[Tensor, "*lead h i t"]) -> Float[Tensor, "*lead h i t"]:
    return w


@dataclass(frozen=True)
class Recipe:
    """One way to read a measure from stored maps: ``derive(Factors)`` given ``sources``."""

    sources: tuple[str, ...]
    derive: Callable[[Factors], Tensor]


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
        recipes: ways to read the measure from other stored maps and the per-layer norms,
            in order of preference (:func:`stored_measures` plans which maps a trace keeps).
        derived_only: never stored as a map of its own (it is a cheap function of one).
        in_all: part of ``"all"`` (``distance``, which costs T²·d per head and layer,
            and ``ihc``, which is ``|contribution|``, are not).
        writes_out: ``compute(lt, out=dest)`` writes the result into ``dest`` (a trace
            passes its storage, saving a copy of every map).
    """

    name: str
    compute: Callable[..., Tensor]
    description: str
    normalise: Callable[[Tensor], Tensor] | None = None
    signed: bool = False
    recipes: tuple[Recipe, ...] = ()
    derived_only: bool = False
    in_all: bool = True
    writes_out: bool = False

    @property
    def is_weight(self) -> bool:
        return self.normalise is not None

    def recipe(self, stored: Iterable[str]) -> Recipe | None:
        """The first recipe whose sources are all in ``stored``."""
        have = set(stored)
        return next((r for r in self.recipes if set(r.sources) <= have), None)

    @property
    def how(self) -> str:
        """How a trace gets this measure, for ``cw measures`` and the docs."""
        ways = [
            "from the norms" if not r.sources else "from " + " and ".join(r.sources)
            for r in self.recipes
        ]
        if self.derived_only:
            return "derived " + ", or ".join(ways)
        return "computed" + (f", or derived {', or '.join(ways)}" if ways else "")


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
    """``"all"``, one name, a comma-separated string or a list (which may hold ``"all"``,
    e.g. ``"all,distance"``), checked and deduplicated.

    ``"all"`` is every measure marked ``in_all`` (not ``distance`` nor ``ihc``).
    """
    if measures is None or measures == "all":
        return [m for m in measure_names() if _MEASURES[m].in_all]
    if isinstance(measures, str):
        measures = [m.strip() for m in measures.split(",") if m.strip()]
    names: list[str] = []
    for name in measures:
        for one in resolve_measures("all") if name == "all" else [name]:  # "all,distance"
            get_measure(one)
            if one not in names:
                names.append(one)
    if not names:
        raise ValueError(f"no measure named; valid measures: {', '.join(measure_names())}")
    return names


_RELATIVE_NORM = Recipe((), layer.relative_norm_from)
_VW = Recipe(("attention",), layer.vw_from)
_VW_ON = Recipe(("attention",), layer.vw_on_from)
_CONTRIBUTION = Recipe(("attention", "projection"), layer.contribution_from)
_COSINE = Recipe(("projection",), layer.cosine_from)
_IHC = (
    Recipe(("contribution",), layer.ihc_from),
    Recipe(_CONTRIBUTION.sources, layer.ihc_from_factor),
)

for _m in (
    Measure(
        "attention", layer.attention, "attention probability α", _divide_by_heads, writes_out=True
    ),
    Measure(
        "contribution",
        layer.contribution,
        "inter-head contribution ĉ = ⟨o_i, α ṽ_j⟩/‖o_i‖² = α·p",
        _as_is,
        signed=True,
        recipes=(_CONTRIBUTION,),
        writes_out=True,
    ),
    Measure(
        "intra",
        layer.intra,
        "intra-head contribution č = ⟨o_i^h, α ṽ_j⟩/‖o_i^h‖²",
        _divide_by_heads,
        signed=True,
        writes_out=True,
    ),
    Measure(
        "relative_norm",
        layer.relative_norm,
        "relative norm r = ‖ṽ_j‖/‖o_i‖",
        recipes=(_RELATIVE_NORM,),
        derived_only=True,
    ),
    Measure(
        "cosine",
        layer.cosine,
        "cosine κ = cos(o_i, ṽ_j) = p·‖o_i‖/‖ṽ_j‖",
        signed=True,
        recipes=(_COSINE,),
        writes_out=True,
    ),
    Measure(
        "vw",
        layer.vw,
        "value-weighted attention α‖ṽ_j‖",
        _per_query_sum,
        recipes=(_VW,),
        derived_only=True,
    ),
    Measure(
        "vw_on",
        layer.vw_on,
        "output-normalised value-weighted α‖ṽ_j‖/‖o_i‖",
        _per_query_sum,
        recipes=(_VW_ON,),
        derived_only=True,
    ),
    Measure(
        "distance",
        layer.distance,
        "distance-based (Ferrando et al. 2022); T²·d per head, only when named",
        _as_is,
        in_all=False,
    ),
    Measure(
        "ihc",
        layer.ihc,
        "|ĉ|, the importance used for faithfulness",
        _per_query_sum,
        recipes=_IHC,
        derived_only=True,
        in_all=False,
    ),
    Measure(
        "projection",
        layer.projection,
        "p = ⟨o_i, ṽ_j⟩/‖o_i‖² = r·κ, the factor a trace stores for ĉ = α·p and κ",
        signed=True,
        in_all=False,
        writes_out=True,
    ),
):
    register_measure(_m)


def compute_measures(lt: LayerTensors, names: Sequence[str]) -> dict[str, Tensor]:
    return {name: get_measure(name).compute(lt) for name in names}


def stored_measures(names: Sequence[str], dtype: torch.dtype = torch.float32) -> list[str]:
    """The maps a trace of ``names`` computes and keeps, in registry order; the other
    measures are derived from them when read (:attr:`Measure.recipes`).

    With the attention α kept (for ``attention``, ``vw`` or ``vw_on``), the contribution
    and the cosine both come from one more map, p = ⟨o_i, ṽ_j⟩/‖o_i‖² (ĉ = α·p and
    κ = p·‖o_i‖/‖ṽ_j‖, the very arithmetic of computing them), unless the storage dtype is
    float16, whose range p (= r·κ, unbounded as ‖o_i‖ → 0) may exceed.
    """
    wanted = set(names)
    stored: set[str] = set()
    if wanted & {"attention", "vw", "vw_on"}:
        stored.add("attention")
    pairs = wanted & {"contribution", "ihc"} and "attention" in stored
    if dtype != torch.float16 and ("cosine" in wanted or pairs):
        stored.add("projection")
        if wanted & {"contribution", "ihc"}:
            stored.add("attention")
    for name in names:
        m = get_measure(name)
        if name in stored or m.recipe(stored) is not None:
            continue
        stored.update(m.recipes[0].sources if m.derived_only else (name,))
    return [m for m in measure_names() if m in stored]


__all__ = [
    "Measure",
    "Recipe",
    "compute_measures",
    "get_measure",
    "measure_names",
    "register_measure",
    "resolve_measures",
    "stored_measures",
]
