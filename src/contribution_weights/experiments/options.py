"""Experiment options declared once: dataclass fields that carry their own CLI description.

An option is a dataclass field made with :func:`option`: its default, its help text, its
command-line flag (and deprecated aliases) and how the flag's text is parsed. The
options class validates itself in ``__post_init__`` (:class:`Options`), so the Python
API and ``cw`` raise the same :class:`ValueError` for the same bad value, and
``cli/options.py`` generates the ``argparse`` arguments from the fields. Nothing here
imports ``argparse``: the parse kinds are names the CLI maps to parsers.

The options of each experiment (:class:`FaithfulnessOptions`, :class:`DownstreamOptions`,
:class:`GeometryOptions`) live here too, not beside the experiments, because this module
imports nothing heavy: ``cw faithfulness --help`` and a bad flag answer before torch is
imported. Checking the measures imports the measure registry, when options are made.
kv-eval's (:class:`KVEvalOptions`) are in its package, ``kv_eval/options.py``, as light,
and re-exported here.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..defaults import (
    BASELINES,
    END_TO_END_RANKINGS,
    INTERVENTIONS,
    MODES,
    SCOPES,
    SINK_COSINE,
    SINK_LAYER_THRESHOLD,
)

if TYPE_CHECKING:
    from ..interventions import Removal

from ..fields import PARSE_KINDS as PARSE_KINDS
from ..fields import Options as Options
from ..fields import as_floats as as_floats
from ..fields import as_ints as as_ints
from ..fields import option as option
from ..fields import split_names as split_names
from .kv_eval.options import KVEvalOptions as KVEvalOptions  # kv-eval's own, re-exported
from .kv_eval.options import check_ruler_tasks as check_ruler_tasks
from .kv_eval.options import check_settings as check_settings

DEFAULT_MEASURES = ("attention", "vw", "vw_on", "ihc")
#: what a removal sweep may run as baselines: those, and the end-to-end attributions
REMOVAL_BASELINES = (*BASELINES, *END_TO_END_RANKINGS)
DEFAULT_RATES = (0.1, 0.2, 0.3, 0.4, 0.5)
DEFAULT_GAMMAS = (1.0, 0.8, 0.6, 0.4, 0.2, 0.0)


def max_tokens_option(help: str, default: int = 512) -> Any:
    """The ``--max-tokens`` option (an int, checked by :func:`check_max_tokens`)."""
    return option(default, help, flag="--max-tokens", parse="int")


def _resolve_measures(measures: Any) -> list[str]:
    """Measure names checked against the registry (imported here: it needs torch)."""
    from ..measures.registry import resolve_measures

    return resolve_measures(measures)


@dataclass
class RemovalOptions(Options):
    """What the removal experiments (faithfulness, downstream) share: the measures that
    rank tokens, the removal rates, sink protection and how a removed token leaves a head.

    ``intervention``: ``value_zero`` (the paper's: its projected value set to 0, the
    weights not renormalised), ``key_mask`` (the token leaves the softmax of every head;
    the weights renormalise), ``mean_value`` (its value replaced by the mean value the
    query sees). docs/method.md says what each measures and which measure each could favour.
    """

    measures: list[str] = option(
        DEFAULT_MEASURES, "comma-separated measures (any registered measure)",
        flag="--measures", parse="names",
    )  # fmt: skip
    rates: list[float] = option(
        DEFAULT_RATES, "removal rates p, each in [0, 1]", flag="--rates", parse="floats"
    )
    protect_sinks: bool = option(
        True, "let sink tokens be removed too (appendix C.3)",
        flag="--no-sink-protection", parse="no-flag",
    )  # fmt: skip
    sink_cosine: float = option(
        SINK_COSINE,
        "a token is a sink at a layer when its layer-input hidden state has cosine above "
        "this with token 0's",
        flag="--sink-cosine", parse="float", aliases=("--sink-threshold",),
    )  # fmt: skip
    baselines: list[str] = option(
        ("random", "recency"),
        "baselines ranked like the measures: random (seeded uniform, --random-seeds of "
        "them), recency (the latest tokens first), and the end-to-end attributions flow, "
        "rollout, alti (one score per token from the clean text, the same in every layer "
        "and head); none for no baseline",
        flag="--baselines", parse="names",
    )  # fmt: skip
    random_seeds: int = option(
        3, "seeds of the random baseline", flag="--random-seeds", parse="int"
    )
    intervention: str = option(
        "value_zero",
        "how a removed token leaves a head: value_zero (its value set to 0, no "
        "renormalisation: the paper's), key_mask (out of the softmax, which renormalises), "
        "mean_value (its value replaced by the mean value the query sees)",
        flag="--intervention", choices=INTERVENTIONS,
    )  # fmt: skip

    def validate(self) -> None:
        self.measures = _resolve_measures(self.measures)  # a string is a name or "a,b"
        self.rates = check_rates(self.rates)
        self.sink_cosine = check_sink_cosine(self.sink_cosine)
        self.protect_sinks = bool(self.protect_sinks)
        self.baselines, self.random_seeds = check_baselines(
            self.baselines, self.random_seeds, REMOVAL_BASELINES
        )
        if self.intervention not in INTERVENTIONS:
            raise ValueError(
                f"unknown intervention {self.intervention!r}; choose from "
                f"{', '.join(INTERVENTIONS)}"
            )

    def rankings(self) -> list[str]:
        """What ranks tokens: the measures, then the baselines (``random:SEED`` per seed)."""
        return with_baselines(self.measures, self.baselines, self.random_seeds)


@dataclass
class FaithfulnessOptions(RemovalOptions):
    """Options of :func:`faithfulness` and ``cw faithfulness`` (checked on creation)."""

    modes: list[str] = option(
        MODES, "comprehensiveness and/or sufficiency", flag="--modes", parse="names"
    )
    scope: str = option("layer", "ranking scope", flag="--scope", choices=SCOPES)
    max_tokens: int = max_tokens_option(
        "keep the first N tokens of longer texts (texts under 2 tokens are skipped)"
    )

    def validate(self) -> None:
        super().validate()
        self.modes = list(dict.fromkeys(split_names(self.modes)))
        for m in self.modes:
            if m not in MODES:
                raise ValueError(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
        if not self.modes:
            raise ValueError(f"no mode given; choose from {', '.join(MODES)}")
        if self.scope not in SCOPES:
            raise ValueError(f"unknown scope {self.scope!r}; choose from {', '.join(SCOPES)}")
        self.max_tokens = check_max_tokens(self.max_tokens)

    def check(self) -> FaithfulnessOptions:
        """Validated already on creation; kept for callers of the older API."""
        self.validate()
        return self

    def removals(self) -> list[Removal]:
        from ..interventions import Removal

        return [
            Removal(m, mode, rate)
            for m, mode, rate in itertools.product(self.rankings(), self.modes, self.rates)
        ]


def check_baselines(
    baselines: Any, random_seeds: Any, known: Sequence[str] = BASELINES
) -> tuple[list[str], int]:
    """Distinct baseline names among ``known`` (``none`` dropped) and a seed count of at
    least 1."""
    names = [b for b in split_names(baselines) if b != "none"]
    for b in names:
        if b not in known:
            raise ValueError(f"unknown baseline {b!r}; choose from {', '.join(known)} (or none)")
    if int(random_seeds) < 1:
        raise ValueError(f"random_seeds must be at least 1, got {random_seeds}")
    return list(dict.fromkeys(names)), int(random_seeds)


def with_baselines(rankings: Sequence[str], baselines: Sequence[str], seeds: int) -> list[str]:
    """``rankings``, then the baselines (``random`` as ``random:SEED`` per seed)."""
    out = list(rankings)
    for b in baselines:
        out += [f"random:{k}" for k in range(seeds)] if b == "random" else [b]
    return out


def check_rates(rates: Any) -> list[float]:
    """Sorted distinct removal rates, each in [0, 1]."""
    out = sorted(set(as_floats(rates)))
    if not out or any(not 0 <= r <= 1 for r in out):
        raise ValueError(f"rates must be in [0, 1], got {rates}; pass e.g. 0.1,0.5")
    return out


def check_max_tokens(max_tokens: Any, least: str = "a token and its next") -> int:
    """``max_tokens`` as an int, at least 2 (``least``: what the two tokens are)."""
    if int(max_tokens) < 2:
        raise ValueError(f"max_tokens must be at least 2 ({least}), got {max_tokens}")
    return int(max_tokens)


def check_sink_cosine(value: Any) -> float:
    if not -1 <= float(value) <= 1:
        raise ValueError(
            f"sink_cosine is a cosine, in [-1, 1]; got {value} (default {SINK_COSINE})"
        )
    return float(value)


@dataclass
class DownstreamOptions(RemovalOptions):
    """Options of :func:`downstream` and ``cw downstream`` (checked on creation)."""

    max_tokens: int = max_tokens_option(
        "skip items whose prompt plus longest option exceed N tokens"
    )

    def validate(self) -> None:
        super().validate()
        self.max_tokens = check_max_tokens(self.max_tokens, "a prompt token and an option token")

    def removals(self) -> list[Removal]:
        from ..interventions import Removal

        return [Removal(m, "sufficiency", r) for m in self.rankings() for r in self.rates]


@dataclass
class GeometryOptions(Options):
    """Options shared by the analyses and ``cw geometry`` (checked on creation).

    Attributes:
        max_tokens: texts longer than this are cut to their first ``max_tokens`` tokens.
        cap: most sampled (query, key, head, layer) points kept for the regressions (per
            reservoir: all pairs, and j = 0 pairs).
        folds: cross-validation folds of the regressions.
        seed: seed of the point sampling and of the folds.
        gammas: sink-value scales for the perplexity curve.
        sink_layers: layers to scale v_0 in; None detects them (mean α_i0 above
            ``sink_layer_threshold``).
        sink_layer_threshold: a layer is a sink layer when its mean attention to token 0,
            mean α_i0, is above this (a mean attention weight, in [0, 1]; not the
            hidden-state cosine that marks sink tokens in faithfulness).
        low_quantile: outputs at or below this quantile of ‖o_i^(h)‖ count as low-norm.
        cone_coverage: fraction of non-sink values the semantic cone holds.
    """

    max_tokens: int | None = option(256, "cut texts to N tokens", flag="--max-tokens", parse="int")
    cap: int = option(5_000_000, "sampled regression points", flag="--cap", parse="int")
    folds: int = option(5, "cross-validation folds of the regressions")
    seed: int = option(0, "sampling and fold seed", flag="--seed", parse="int")
    gammas: list[float] = option(
        DEFAULT_GAMMAS, "sink-value scales γ, each in [0, 1]", flag="--gammas", parse="floats"
    )
    sink_layers: list[int] | None = option(
        None,
        "layers to scale v_0 in, e.g. 2-29 (default: detected, mean α_i0 above "
        "--sink-layer-threshold)",
        flag="--sink-layers", parse="ints",
    )  # fmt: skip
    sink_layer_threshold: float = option(
        SINK_LAYER_THRESHOLD,
        "a layer is a sink layer when its mean attention to token 0 is above this",
        flag="--sink-layer-threshold", parse="float", aliases=("--sink-threshold",),
    )  # fmt: skip
    low_quantile: float = option(0.25, "quantile of ‖o_i^(h)‖ at or below which it is low")
    cone_coverage: float = option(0.9, "fraction of non-sink values the semantic cone holds")

    def validate(self) -> None:
        if self.max_tokens is not None and int(self.max_tokens) < 2:
            raise ValueError(f"max_tokens must be at least 2, not {self.max_tokens}")
        if int(self.cap) < 1:
            raise ValueError(f"cap must be at least 1, not {self.cap}")
        if int(self.folds) < 2:
            raise ValueError(f"folds must be at least 2, not {self.folds}")
        gammas = as_floats(self.gammas)
        if not gammas or any(not 0 <= g <= 1 for g in gammas):
            raise ValueError(f"gammas must lie in [0, 1], got {self.gammas}")
        self.gammas = gammas
        if self.sink_layers is not None:
            self.sink_layers = [int(x) for x in self.sink_layers]
        if not 0 <= float(self.sink_layer_threshold) <= 1:
            raise ValueError(
                "sink_layer_threshold is a mean attention weight, in [0, 1]; got "
                f"{self.sink_layer_threshold} (default {SINK_LAYER_THRESHOLD})"
            )
        self.sink_layer_threshold = float(self.sink_layer_threshold)
        if not 0 < float(self.low_quantile) < 1 or not 0 < float(self.cone_coverage) <= 1:
            raise ValueError("low_quantile must lie in (0, 1) and cone_coverage in (0, 1]")
