"""Value geometry and attention sinks (paper §6 and appendix D; method §3, §5), for any model.

One function per analysis, each taking a :class:`~..loading.LoadedModel` and texts (or
token-id lists) and returning a tidy result::

    component_regression(model, texts)   # Tables 1 and 3: held-out R², 5-fold CV
    log_correlations(model, texts)       # Table 2
    first_token_weight(model, texts)     # Table 4, overall and per layer
    entropy(model, texts)                # Table 5, all tokens and j ≥ 1
    sink_alignment(model, texts)         # Figure 5
    sink_scaling(model, texts)           # Figure 6c
    norm_fit(model, texts)               # §6.2, per head
    semantic_cone(model, texts)          # Figure 6a/b
    joint_distributions(model, texts)    # Figure 7

They all run on :class:`GeometryAccumulator`, a capture observer that feeds each layer's
:class:`~..measures.layer.LayerTensors` to the streaming statistics of :mod:`.stats` and
:mod:`.sinks`, one sequence at a time. :func:`analyse` computes every analysis in one pass
per sequence (plus the γ-batched sink-scaling passes) and returns a
:class:`~.geometry_result.GeometryResult`; the ``cw geometry`` command adds a resumable
run folder on top (:mod:`.geometry_run`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from ..capture import LayerCall, capturing, check_all_layers_seen
from ..inputs import encode, resolve_layers
from ..loading import LoadedModel
from .geometry_result import GeometryResult, SinkScalingResult, build_result
from .sinks import NormFit, SemanticCone, detect_sink_layers, sink_scaling_nll
from .stats import (
    BlockView,
    ComponentPoints,
    Entropy,
    FirstTokenWeight,
    LogCorrelations,
    SinkAlignment,
    SinkRate,
    Stat,
)

ANALYSES = (
    "regression",
    "correlations",
    "first_token_weight",
    "entropy",
    "sink_alignment",
    "sink_scaling",
    "norm_fit",
    "semantic_cone",
    "joint_distributions",
)
DEFAULT_GAMMAS = (1.0, 0.8, 0.6, 0.4, 0.2, 0.0)


class NoSinkLayersWarning(UserWarning):
    """No sink layer was found, so the sink-value scaling passes were skipped."""


@dataclass
class GeometryOptions:
    """Options shared by the analyses and ``cw geometry``.

    Attributes:
        max_tokens: texts longer than this are cut to their first ``max_tokens`` tokens.
        cap: most sampled (query, key, head, layer) points kept for the regressions (per
            reservoir: all pairs, and j = 0 pairs).
        folds: cross-validation folds of the regressions.
        seed: seed of the point sampling and of the folds.
        gammas: sink-value scales for the perplexity curve.
        sink_layers: layers to scale v_0 in; None detects them (mean α_i0 > threshold).
        sink_threshold: the detection threshold on the layer's mean α_i0.
        low_quantile: outputs at or below this quantile of ‖o_i^(h)‖ count as low-norm.
        cone_coverage: fraction of non-sink values the semantic cone holds.
    """

    max_tokens: int | None = 256
    cap: int = 5_000_000
    folds: int = 5
    seed: int = 0
    gammas: Sequence[float] = DEFAULT_GAMMAS
    sink_layers: Sequence[int] | None = None
    sink_threshold: float = 0.5
    low_quantile: float = 0.25
    cone_coverage: float = 0.9

    def to_dict(self) -> dict[str, Any]:
        d = dict(vars(self))
        d["gammas"] = [float(g) for g in self.gammas]
        d["sink_layers"] = None if self.sink_layers is None else [int(x) for x in self.sink_layers]
        return d


def resolve_analyses(only: str | Iterable[str] | None) -> list[str]:
    """``None`` (all), a comma-separated string, or names; checked against :data:`ANALYSES`."""
    if only is None:
        return list(ANALYSES)
    names = [n.strip() for n in only.split(",")] if isinstance(only, str) else list(only)
    aliases = {
        "regression_r2": "regression",
        "log_regression_r2": "regression",
        "joint": "joint_distributions",
    }
    out: list[str] = []
    for name in filter(None, names):
        name = aliases.get(name, name)
        if name not in ANALYSES:
            raise ValueError(f"unknown analysis {name!r}; valid: {', '.join(ANALYSES)}")
        if name not in out:
            out.append(name)
    if not out:
        raise ValueError(f"no analysis named; valid: {', '.join(ANALYSES)}")
    return out


@dataclass
class GeometryAccumulator:
    """Capture observer accumulating the requested statistics over sequences (batch 1)."""

    num_layers: int
    num_heads: int
    analyses: list[str]
    options: GeometryOptions = field(default_factory=GeometryOptions)
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        o, n, h = self.options, self.num_layers, self.num_heads
        want = set(self.analyses)
        self.stats: dict[str, Stat] = {"sink_rate": SinkRate(n)}
        if want & {"regression", "joint_distributions"}:
            self.stats["points"] = ComponentPoints(n, o.cap, o.seed)
        if "correlations" in want:
            self.stats["correlations"] = LogCorrelations(n)
        if "first_token_weight" in want:
            self.stats["first_token_weight"] = FirstTokenWeight(n)
        if "entropy" in want:
            self.stats["entropy"] = Entropy(n)
        if "sink_alignment" in want:
            self.stats["sink_alignment"] = SinkAlignment(n)
        if "norm_fit" in want:
            self.stats["norm_fit"] = NormFit(n, h)
        if "semantic_cone" in want:
            self.stats["semantic_cone"] = SemanticCone(n, h, o.low_quantile, o.cone_coverage)
        self.sequences = 0
        self.scaling_nll: list[list[float]] = []  # per sequence, one NLL per γ
        self.sink_layers: list[int] | None = None
        self.scaling_skipped: str | None = None  # why the sink-scaling passes did not run
        self._tokens = 0
        self._scratch: dict[int, dict[str, Any]] = {}

    # ---- observer protocol -----------------------------------------------------------
    def begin_sequence(self, num_tokens: int) -> None:
        self._tokens = num_tokens
        self._scratch = {}
        for stat in self.stats.values():
            stat.begin(num_tokens)

    def observe(self, call: LayerCall, rows: slice, probs: Tensor) -> None:
        if call.batch != 1:
            raise ValueError("geometry statistics take one sequence at a time (batch 1)")
        lt = call.layer_tensors(rows, probs, self.dtype)
        scratch = self._scratch.setdefault(call.layer_idx, {})
        view = BlockView(call.layer_idx, rows, lt, self._tokens, scratch)
        for stat in self.stats.values():
            stat.observe(view)

    def end_sequence(self) -> None:
        for stat in self.stats.values():
            stat.end()
        self.sequences += 1

    # ---- running -------------------------------------------------------------------
    def add_sequence(self, model: LoadedModel, ids: Tensor) -> None:
        """One clean forward pass of ``ids (T,)`` through every statistic."""
        self.begin_sequence(int(ids.numel()))
        with torch.no_grad(), capturing(model.model, [self]) as session:
            model.model(input_ids=ids[None].to(model.device), use_cache=False)
            check_all_layers_seen(session, model.num_layers)
        self.end_sequence()

    def resolve_sink_layers(self) -> list[int]:
        """The given sink layers, or those detected from the mean α_i0 seen so far."""
        if self.options.sink_layers is not None:
            self.sink_layers = resolve_layers(
                list(self.options.sink_layers), self.num_layers, allow_empty=True
            )
        elif self.sink_layers is None:
            rate = self.stats["sink_rate"]
            assert isinstance(rate, SinkRate)
            self.sink_layers = detect_sink_layers(
                rate.by_layer()[:, 0], self.options.sink_threshold
            )
        return self.sink_layers

    def plan_scaling(self) -> bool:
        """Fix the sink layers; with none, warn, record why and return False (no passes).

        Scaling v_0 in no layer changes nothing: the passes would cost full forwards per
        sequence and γ for a flat curve.
        """
        if self.resolve_sink_layers():
            self.scaling_skipped = None
            return True
        if self.options.sink_layers is not None:
            self.scaling_skipped = "the given sink layers are empty"
        else:
            rate = self.stats["sink_rate"]
            assert isinstance(rate, SinkRate)
            by_layer = rate.by_layer()[:, 0]
            top = int(np.nanargmax(by_layer)) if np.isfinite(by_layer).any() else None
            highest = "" if top is None else f" (highest {by_layer[top]:.3f}, layer {top})"
            self.scaling_skipped = (
                "no layer has mean α_i0 above the sink threshold "
                f"{self.options.sink_threshold}{highest}; pass --sink-layers "
                "(GeometryOptions.sink_layers) or a lower --sink-threshold to scale v_0 anyway"
            )
        message = f"sink-value scaling skipped: {self.scaling_skipped}"
        warnings.warn(message, NoSinkLayersWarning, stacklevel=2)
        return False

    def add_scaling(self, model: LoadedModel, ids: Tensor) -> None:
        """The sink-value scaling passes of one sequence (after sink layers are fixed)."""
        layers = self.resolve_sink_layers()
        if ids.numel() < 2:  # no next token to predict: recorded as missing
            self.scaling_nll.append([float("nan")] * len(self.options.gammas))
            return
        self.scaling_nll.append(sink_scaling_nll(model, ids, self.options.gammas, layers))

    def result(self) -> GeometryResult:
        return build_result(self)

    # ---- persistence -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "sequences": self.sequences,
            "scaling_nll": self.scaling_nll,
            "sink_layers": self.sink_layers,
            "scaling_skipped": self.scaling_skipped,
            "stats": {k: s.state_dict() for k, s in self.stats.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sequences = int(state["sequences"])
        self.scaling_nll = [list(x) for x in state["scaling_nll"]]
        self.sink_layers = state["sink_layers"]
        self.scaling_skipped = state.get("scaling_skipped")
        for key, stat in self.stats.items():
            stat.load_state_dict(state["stats"][key])


def encode_texts(
    model: LoadedModel, texts: Iterable[str | Sequence[int] | Tensor], max_tokens: int | None
) -> list[Tensor]:
    """Token ids of each text, cut to ``max_tokens``."""
    return [encode(model, t, max_tokens, truncate=True) for t in texts]


def analyse(
    model: LoadedModel,
    texts: Iterable[str | Sequence[int] | Tensor],
    analyses: str | Iterable[str] | None = None,
    options: GeometryOptions | None = None,
    progress: bool = False,
) -> GeometryResult:
    """Run the requested analyses (default: all) over ``texts``; see the module docstring."""
    from tqdm.auto import tqdm

    options = options or GeometryOptions()
    names = resolve_analyses(analyses)
    acc = GeometryAccumulator(model.num_layers, model.num_heads, names, options)
    ids = encode_texts(model, texts, options.max_tokens)
    for seq in tqdm(ids, desc="geometry", disable=not progress):
        acc.add_sequence(model, seq)
    if "sink_scaling" in names and acc.plan_scaling():
        for seq in tqdm(ids, desc="sink scaling", disable=not progress):
            acc.add_scaling(model, seq)
    return acc.result()


def _one(
    model: LoadedModel, texts: Any, name: str, options: GeometryOptions | None
) -> GeometryResult:
    return analyse(model, texts, [name], options)


def component_regression(
    model: LoadedModel, texts: Any, options: GeometryOptions | None = None
) -> pd.DataFrame:
    """Tables 1 and 3: rows (scale, features), columns all / first / tail held-out R²."""
    res = _one(model, texts, "regression", options)
    assert res.regression_r2 is not None and res.log_regression_r2 is not None
    return pd.concat(
        [res.regression_r2.assign(scale="linear"), res.log_regression_r2.assign(scale="log")]
    )


def log_correlations(
    model: LoadedModel, texts: Any, options: GeometryOptions | None = None
) -> pd.DataFrame:
    """Table 2: Pearson correlations of log α, log r, log|κ| (token group ``all``)."""
    return _one(model, texts, "correlations", options).correlations


def first_token_weight(
    model: LoadedModel, texts: Any, options: GeometryOptions | None = None
) -> pd.DataFrame:
    """Table 4 per layer (columns attention, vw, contribution); ``.mean()`` gives the overall."""
    return _one(model, texts, "first_token_weight", options).first_token_weight_by_layer


def entropy(model: LoadedModel, texts: Any, options: GeometryOptions | None = None) -> pd.DataFrame:
    """Table 5: rows ``all`` / ``excluding_first``, columns attention, vw, contribution."""
    return _one(model, texts, "entropy", options).entropy


def sink_alignment(
    model: LoadedModel, texts: Any, options: GeometryOptions | None = None
) -> pd.DataFrame:
    """Figure 5: per layer, mean cos(ṽ_0, ṽ_j) (``sink_tail``) and cos(ṽ_i, ṽ_j) (``tail_tail``)."""
    return _one(model, texts, "sink_alignment", options).sink_alignment


def sink_scaling(
    model: LoadedModel, texts: Any, options: GeometryOptions | None = None
) -> SinkScalingResult:
    """Figure 6c: perplexity against γ with v_0 scaled by γ in the sink layers."""
    res = _one(model, texts, "sink_scaling", options)
    assert res.sink_scaling is not None
    return res.sink_scaling


def norm_fit(
    model: LoadedModel, texts: Any, options: GeometryOptions | None = None
) -> pd.DataFrame:
    """§6.2: one row per head: γ', κ'², ‖ṽ_0‖², α_min, convexity, R²."""
    return _one(model, texts, "norm_fit", options).norm_fit


def semantic_cone(
    model: LoadedModel, texts: Any, options: GeometryOptions | None = None
) -> pd.DataFrame:
    """Figure 6a/b: per layer, fractions of (low-norm) head outputs inside the cone."""
    return _one(model, texts, "semantic_cone", options).semantic_cone


def joint_distributions(
    model: LoadedModel, texts: Any, options: GeometryOptions | None = None
) -> pd.DataFrame:
    """Figure 7: sampled pairs with columns alpha, vnorm, kappa, layer, first."""
    return _one(model, texts, "joint_distributions", options).joint


__all__ = [
    "ANALYSES",
    "GeometryAccumulator",
    "GeometryOptions",
    "GeometryResult",
    "NoSinkLayersWarning",
    "analyse",
    "component_regression",
    "entropy",
    "first_token_weight",
    "joint_distributions",
    "log_correlations",
    "norm_fit",
    "resolve_analyses",
    "semantic_cone",
    "sink_alignment",
    "sink_scaling",
]
