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

A measure carries its own algebra, so nothing elsewhere lists measure names:

* ``recipes``: how it is read from stored maps (the storage planner picks the fewest maps
  from which every requested measure can be read, :func:`stored_measures`);
* ``algebra``: how its reductions follow from another measure's block without computing
  it (:class:`RowScaled`: ``vw_on = vw / ‖o_i‖``; :class:`AbsoluteOf`: ``ihc = |ĉ|``;
  :class:`RankOne`: ``relative_norm = ‖ṽ_j‖ · 1/‖o_i‖``; :class:`ScaledBlock`:
  ``cosine = ‖o_i‖ · p · 1/‖ṽ_j‖``, summed by matrix–vector products on ``p``);
* ``column_sums``: Σ_i w_ij per key without the map (faithfulness ranks tokens by these);
* ``half_precision``: whether float16 storage can hold it (``projection`` is unbounded);
* ``factor``: a map several measures are read from, preferred when the planner must choose;
* ``style``: its colour, marker and label in every figure.
"""

# ruff: noqa: F722  (jaxtyping shape strings are not forward references)

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import combinations

import torch
from jaxtyping import Float
from torch import Tensor

from ..defaults import BASELINES, END_TO_END_RANKINGS
from ..registry import Registry
from . import layer, shortcuts
from .distance import distance
from .layer import Factors, LayerTensors, LayerVectors, reciprocal, safe_div


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
class RowScaled:
    """The measure is ``base`` with each query row scaled by ``scale(lt)`` ≥ 0, ``(B, I)``:
    its entropies and top keys are ``base``'s, its sums scale."""

    base: str
    scale: Callable[[LayerTensors], Tensor]


@dataclass(frozen=True)
class AbsoluteOf:
    """The measure is ``|base|``: its entropies and top keys are ``|base|``'s."""

    base: str


@dataclass(frozen=True)
class RankOne:
    """The measure is ``key_factor(lt)_j · query_factor(lt)_i`` on the valid pairs
    (``(B, H, T)`` and ``(B, I)``): its sums are matrix–vector products, no map at all."""

    key_factor: Callable[[LayerVectors], Tensor]
    query_factor: Callable[[LayerVectors], Tensor]


@dataclass(frozen=True)
class ScaledBlock:
    """The measure, not a weight, is ``query_factor(lt)_i · block(lt)_ij · key_factor(lt)_j``
    for a ``(B, H, I, T)`` block the layer's tensors hold anyway, zero where the query may
    not attend (factors ``(B, I)`` and ``(B, H, T)``; None: 1). A measure that is not a
    weight keeps only its column sums, row sums and ``w_i0``: matrix–vector products on
    that block, so no map of its own is built."""

    block: Callable[[LayerTensors], Tensor]
    query_factor: Callable[[LayerTensors], Tensor] | None = None
    key_factor: Callable[[LayerTensors], Tensor] | None = None

    def parts(self, lt: LayerTensors) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The block ``(H, I, K)`` and the factors of batch row 0."""
        q, k = self.query_factor, self.key_factor
        return self.block(lt)[0], None if q is None else q(lt)[0], None if k is None else k(lt)[0]


Algebra = RowScaled | AbsoluteOf | RankOne | ScaledBlock


@dataclass(frozen=True)
class Style:
    """How figures draw a measure: a matplotlib colour, a marker, and a label."""

    colour: str
    marker: str = "o"
    label: str = ""


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
        algebra: how its reductions follow from another measure's (module docstring).
        column_sums: ``LayerTensors -> (B, H, T)`` Σ_i w_ij per key without the map, where
            the sum factorises (used to rank tokens; None: the map is summed).
        log_terms: ``LayerTensors -> (s, lse, c)`` with ``ln w_ij = s_ij − lse_i + c_j``
            (batch row 0; ``c`` may be None), known from the scores capture kept, so the
            entropies take no logarithm; None where no scores were kept.
        half_precision: float16 storage can hold it.
        factor: a map other measures are read from; preferred by the storage planner.
        style: colour, marker and label in figures (None: the next colour of the cycle).
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
    algebra: Algebra | None = None
    column_sums: Callable[[LayerTensors], Tensor] | None = None
    log_terms: Callable[[LayerTensors], tuple[Tensor, Tensor, Tensor | None] | None] | None = None
    half_precision: bool = True
    factor: bool = False
    style: Style | None = None

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


MEASURES: Registry[Measure] = Registry("measure", in_all=lambda m: m.in_all)


def register_measure(measure: Measure) -> Measure:
    """Add (or replace) a measure; it becomes available everywhere by its name.

    The names of the removal experiments' baseline rankings (``random``, ``random:SEED``,
    ``recency``, ``flow``, ``rollout``, ``alti``) are refused: a measure of that name
    would be shadowed by the baseline wherever rankings are named.
    """
    name = measure.name.strip().lower()
    if name in (*BASELINES, *END_TO_END_RANKINGS) or name.startswith("random:"):
        raise ValueError(
            f"a measure cannot be named {measure.name!r}: removal experiments use that name "
            "for a baseline ranking; choose another name"
        )
    return MEASURES.register(measure)


def get_measure(name: str) -> Measure:
    return MEASURES.get(name)


def measure_names() -> list[str]:
    return MEASURES.names()


def resolve_measures(measures: str | Iterable[str] | None) -> list[str]:
    """``"all"``, one name, a comma-separated string or a list (which may hold ``"all"``,
    e.g. ``"all,distance"``), checked and deduplicated.

    ``"all"`` is every measure marked ``in_all`` (not ``distance``, ``ihc`` nor ``projection``).
    """
    return MEASURES.resolve(measures)


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
        "attention",
        layer.attention,
        "attention probability α",
        _divide_by_heads,
        writes_out=True,
        column_sums=shortcuts.attention_column_sums,
        log_terms=shortcuts.attention_log_terms,
        style=Style("tab:blue", "o"),
    ),
    Measure(
        "contribution",
        layer.contribution,
        "inter-head contribution ĉ = ⟨o_i, α ṽ_j⟩/‖o_i‖² = α·p",
        _as_is,
        signed=True,
        recipes=(_CONTRIBUTION,),
        writes_out=True,
        style=Style("tab:red", "P"),
    ),
    Measure(
        "intra",
        layer.intra,
        "intra-head contribution č = ⟨o_i^h, α ṽ_j⟩/‖o_i^h‖²",
        _divide_by_heads,
        signed=True,
        writes_out=True,
        style=Style("tab:brown", "<"),
    ),
    Measure(
        "relative_norm",
        layer.relative_norm,
        "relative norm r = ‖ṽ_j‖/‖o_i‖",
        recipes=(_RELATIVE_NORM,),
        derived_only=True,
        algebra=RankOne(lambda lt: lt.value_norm, lambda lt: lt.inv_output_norm),
        style=Style("tab:cyan", ">"),
    ),
    Measure(
        "cosine",
        layer.cosine,
        "cosine κ = cos(o_i, ṽ_j) = p·‖o_i‖/‖ṽ_j‖",
        signed=True,
        recipes=(_COSINE,),
        writes_out=True,
        algebra=ScaledBlock(
            lambda lt: lt.masked_projection,
            lambda lt: lt.output_norm,
            lambda lt: reciprocal(lt.value_norm),
        ),
        style=Style("tab:olive", "*"),
    ),
    Measure(
        "vw",
        layer.vw,
        "value-weighted attention α‖ṽ_j‖",
        _per_query_sum,
        recipes=(_VW,),
        derived_only=True,
        column_sums=shortcuts.vw_column_sums,
        log_terms=shortcuts.vw_log_terms,
        style=Style("tab:orange", "s"),
    ),
    Measure(
        "vw_on",
        layer.vw_on,
        "output-normalised value-weighted α‖ṽ_j‖/‖o_i‖",
        _per_query_sum,
        recipes=(_VW_ON,),
        derived_only=True,
        algebra=RowScaled("vw", lambda lt: lt.inv_output_norm),
        column_sums=shortcuts.vw_on_column_sums,
        style=Style("tab:green", "^"),
    ),
    Measure(
        "distance",
        distance,
        "distance-based (Ferrando et al. 2022); T²·d per head, only when named",
        _as_is,
        in_all=False,
        style=Style("tab:purple", "v"),
    ),
    Measure(
        "ihc",
        layer.ihc,
        "|ĉ|, the importance used for faithfulness",
        _per_query_sum,
        recipes=_IHC,
        derived_only=True,
        in_all=False,
        algebra=AbsoluteOf("contribution"),
        column_sums=shortcuts.ihc_column_sums,
        style=Style("tab:red", "D"),
    ),
    Measure(
        "projection",
        layer.projection,
        "p = ⟨o_i, ṽ_j⟩/‖o_i‖² = r·κ, the factor a trace stores for ĉ = α·p and κ",
        signed=True,
        in_all=False,
        writes_out=True,
        half_precision=False,  # p = r·κ is unbounded as ‖o_i‖ → 0
        factor=True,
        algebra=ScaledBlock(lambda lt: lt.masked_projection),
        style=Style("tab:gray", "x"),
    ),
):
    register_measure(_m)


def compute_measures(lt: LayerTensors, names: Sequence[str]) -> dict[str, Tensor]:
    return {name: get_measure(name).compute(lt) for name in names}


def stored_measures(names: Sequence[str], dtype: torch.dtype = torch.float32) -> list[str]:
    """The maps a trace of ``names`` computes and keeps, in registry order; the other
    measures are derived from them when read (:attr:`Measure.recipes`).

    The fewest maps from which every requested measure is stored or read by a recipe.
    Among equally few: the most shared factors (:attr:`Measure.factor`: with α kept, ĉ and
    κ both come from p = ⟨o_i, ṽ_j⟩/‖o_i‖², the very arithmetic of computing them), then
    the maps from which the most registered measures can be read (α and p rather than ĉ
    and p), then the fewest maps nobody asked for, then registry order. A map that float16
    cannot hold (:attr:`Measure.half_precision`) is kept in float16 only when asked for by
    name.
    """
    wanted = list(dict.fromkeys(names))
    order = {name: i for i, name in enumerate(measure_names())}
    by_name = {m.name: m for m in MEASURES}
    half = dtype == torch.float16
    candidates: set[str] = {n for n in wanted if not get_measure(n).derived_only}
    for name in wanted:
        for recipe in get_measure(name).recipes:
            candidates.update(recipe.sources)
    candidates = {
        c
        for c in candidates
        if not get_measure(c).derived_only
        and (c in wanted or not half or get_measure(c).half_precision)
    }
    ranked = sorted(candidates, key=order.__getitem__)

    def serves(stored: frozenset[str]) -> bool:
        return all(n in stored or get_measure(n).recipe(stored) is not None for n in wanted)

    def cost(stored: frozenset[str]) -> tuple[int, int, int, int, tuple[int, ...]]:
        factors = sum(get_measure(n).factor for n in stored)
        reach = sum(n in stored or m.recipe(stored) is not None for n, m in by_name.items())
        unasked = len(stored - set(wanted))
        return len(stored), -factors, -reach, unasked, tuple(sorted(order[n] for n in stored))

    for size in range(len(ranked) + 1):
        choices = [frozenset(c) for c in combinations(ranked, size)]
        fitting = [c for c in choices if serves(c)]
        if fitting:
            best: frozenset[str] = min(fitting, key=cost)
            return sorted(best, key=order.__getitem__)
    missing = [n for n in wanted if get_measure(n).recipe(candidates) is None]
    raise ValueError(f"no stored maps can give {', '.join(missing)}; give it a recipe")


__all__ = [
    "MEASURES",
    "AbsoluteOf",
    "Algebra",
    "Measure",
    "RankOne",
    "Recipe",
    "RowScaled",
    "Style",
    "compute_measures",
    "get_measure",
    "measure_names",
    "register_measure",
    "resolve_measures",
    "stored_measures",
]
