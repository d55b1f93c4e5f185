"""Running the geometry analyses: the accumulator, the experiment, and one function each.

One function per analysis, each taking a :class:`~...loading.LoadedModel` and texts (or
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
:class:`~...measures.layer.LayerTensors` to the statistics the requested analyses need
(:meth:`~.analysis.Analysis.stats`), one sequence at a time. :func:`analyse` computes
every requested analysis in one pass per sequence (plus the γ-batched sink-scaling
passes) and returns a :class:`~.result.GeometryResult`.

Runs. :class:`Geometry` is the experiment the runner (:mod:`..runner`) drives, and
:func:`run_geometry` runs it into a run folder (what ``cw geometry`` does): phase 1
folds each sequence into the accumulator, whose state (``state.pt``) is replaced
atomically after every sequence; phase 2, the sink-value scaling passes (which need the
sink layers detected from all of phase 1), appends one row per (sequence, γ) to
``sink_scaling.csv`` for the sink and one for the control token. An interrupted run
resumed with the same options continues where it stopped. Split over processes, each
process keeps its own accumulator and the main process merges them (sums add, moments
combine, reservoirs keep the smallest keys of the union, each sequence's keys seeded by
its number), so N processes give the tables of one (to float rounding of the sums). At
the end ``tables.json``, ``per_layer.csv``, ``norm_fit.csv`` and ``meta.json`` are
written; figures and Markdown are the presentation layer's job.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from ...capture import LayerBlock, capturing, check_all_layers_seen
from ...inputs import encode, resolve_layers
from ...loading import LoadedModel
from ...runs import fingerprint
from ..options import GeometryOptions
from ..result import warn_few_samples
from ..runner import Experiment, Phase, run_experiment
from ..state_io import load_state, save_state
from ..stats import BlockView, SinkRate, Stat, control_token
from .analyses.sink_scaling import SinkScalingResult, detect_sink_layers, sink_scaling_nll
from .analysis import make_stats, resolve_analyses
from .result import SCALING_FILE, STATE_FILE, GeometryResult, build_result, split_scaling_rows


class NoSinkLayersWarning(UserWarning):
    """No sink layer was found, so the sink-value scaling passes were skipped."""


@dataclass
class GeometryAccumulator:
    """Capture observer accumulating the requested statistics over sequences (batch 1)."""

    num_layers: int
    num_heads: int
    analyses: list[str]
    options: GeometryOptions = field(default_factory=GeometryOptions)
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Empty statistics (no sequence seen)."""
        self.stats: dict[str, Stat] = make_stats(
            self.analyses, self.num_layers, self.num_heads, self.options
        )
        self.sequences = 0
        self.units: list[int] = []  # the sequences folded in, by their number in the run
        self.scaling_nll: list[list[float]] = []  # per sequence, one NLL per γ
        self.control_nll: list[list[float]] = []  # the same with the control token scaled
        self.sink_layers: list[int] | None = None
        self.scaling_skipped: str | None = None  # why the sink-scaling passes did not run
        self._tokens = 0
        self._scratch: dict[int, dict[str, Any]] = {}

    # ---- observer protocol -----------------------------------------------------------
    def begin_sequence(self, num_tokens: int, unit: int | None = None) -> None:
        """A sequence starts; ``unit`` is its number in the run (default: the next one).

        The number seeds the sampling of its points, so a run split over processes
        samples exactly what one process would.
        """
        self._unit = self.sequences if unit is None else int(unit)
        self._tokens = num_tokens
        self._scratch = {}
        for stat in self.stats.values():
            stat.begin(num_tokens, self._unit)

    def observe(self, view: LayerBlock) -> None:
        if view.call.batch != 1:
            raise ValueError("geometry statistics take one sequence at a time (batch 1)")
        scratch = self._scratch.setdefault(view.layer_idx, {})
        geometry_view = BlockView(view, self._tokens, self.dtype, scratch)
        for stat in self.stats.values():
            stat.observe(geometry_view)

    def end_sequence(self) -> None:
        for stat in self.stats.values():
            stat.end()
        self.sequences += 1
        self.units.append(self._unit)

    # ---- running -------------------------------------------------------------------
    def add_sequence(self, model: LoadedModel, ids: Tensor, unit: int | None = None) -> None:
        """One clean forward pass of ``ids (T,)`` (sequence ``unit`` of the run)."""
        self.begin_sequence(int(ids.numel()), unit)
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
                rate.by_layer()[:, 0], self.options.sink_layer_threshold
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
                "no layer has mean α_i0 above the sink-layer threshold "
                f"{self.options.sink_layer_threshold}{highest}; pass --sink-layers "
                "(GeometryOptions.sink_layers) or a lower --sink-layer-threshold to scale v_0 "
                "anyway"
            )
        message = f"sink-value scaling skipped: {self.scaling_skipped}"
        warnings.warn(message, NoSinkLayersWarning, stacklevel=2)
        return False

    def control_position(self, num_tokens: int, unit: int) -> int | None:
        """The control token of sequence ``unit`` in the scaling passes (seeded)."""
        return control_token(num_tokens, self.options.seed, unit)

    def scaling(
        self, model: LoadedModel, ids: Tensor, unit: int | None = None
    ) -> tuple[list[float], list[float]]:
        """The mean NLL per γ of one sequence (number ``unit`` of the run, default the
        next) with v_0 scaled in the sink layers, and with the control token's value
        scaled instead (NaN for a sequence too short to score)."""
        layers = self.resolve_sink_layers()
        n = len(self.options.gammas)
        if ids.numel() < 2:  # no next token to predict: recorded as missing
            return [float("nan")] * n, [float("nan")] * n
        unit = len(self.scaling_nll) if unit is None else unit
        control = self.control_position(int(ids.numel()), unit)
        nll = sink_scaling_nll(model, ids, self.options.gammas, layers, control=control)
        return nll[:n], nll[n:]

    def add_scaling(self, model: LoadedModel, ids: Tensor, unit: int | None = None) -> None:
        """The sink-value scaling passes of one sequence (after sink layers are fixed)."""
        sink, control = self.scaling(model, ids, unit)
        self.scaling_nll.append(sink)
        self.control_nll.append(control)

    def result(self) -> GeometryResult:
        return build_result(
            self.stats, self.analyses, self.options, self.num_layers, self.sequences,
            self.sink_layers, self.scaling_nll, self.scaling_skipped, self.control_nll,
        )  # fmt: skip

    # ---- persistence -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "sequences": self.sequences,
            "units": list(self.units),
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "stats": {k: s.state_dict() for k, s in self.stats.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sequences = int(state["sequences"])
        # run folders written before units were recorded ran their sequences in order
        self.units = [int(u) for u in state.get("units", range(self.sequences))]
        for key, stat in self.stats.items():
            if key in state["stats"]:  # a statistic newer than the state starts empty
                stat.load_state_dict(state["stats"][key])

    def merge_state(self, state: dict[str, Any]) -> None:
        """Fold in the state of an accumulator over other sequences (another process's)."""
        units = [int(u) for u in state.get("units", [])]
        if set(units) & set(self.units):
            raise ValueError("cannot merge accumulator states that share sequences")
        self.sequences += int(state["sequences"])
        self.units = sorted([*self.units, *units])
        for key, stat in self.stats.items():
            if key in state["stats"]:  # else it misses those sequences (and says so)
                stat.merge(state["stats"][key])


def encode_texts(
    model: LoadedModel, texts: Iterable[str | Sequence[int] | Tensor], max_tokens: int | None
) -> list[Tensor]:
    """Token ids of each text, cut to ``max_tokens``."""
    return [encode(model, t, max_tokens, truncate=True) for t in texts]


class Geometry(Experiment[GeometryResult]):
    """The geometry analyses: phase 1 folds each sequence into the accumulator (a
    mergeable state); phase 2 scales the sink values, one row per (sequence, γ)."""

    name = "geometry"

    def __init__(
        self,
        model: LoadedModel,
        texts: Sequence[str | Sequence[int] | Tensor],
        analyses: str | Sequence[str] | None = None,
        options: GeometryOptions | None = None,
        source: str = "",
    ) -> None:
        if not texts:
            raise ValueError("no texts to analyse; pass --n 1 or more, or a non-empty file")
        self.model, self.texts, self.source = model, list(texts), source
        self.options = options or GeometryOptions()
        self.analyses = resolve_analyses(analyses)
        self.acc = GeometryAccumulator(
            model.num_layers, model.num_heads, self.analyses, self.options
        )
        self.ids = encode_texts(model, self.texts, self.options.max_tokens)

    def config(self) -> dict[str, Any]:
        texts = [t if isinstance(t, str) else [int(x) for x in t] for t in self.texts]
        return {
            "experiment": self.name,
            "model": self.model.name,
            "source": self.source,
            "n_texts": len(self.texts),
            "texts_sha256": fingerprint(texts),
            "analyses": self.analyses,
            **self.options.to_dict(),
        }

    def observe(self, i: int) -> None:
        self.acc.add_sequence(self.model, self.ids[i], unit=i)

    def scale(self, i: int) -> list[dict[str, Any]]:
        """One row per γ with the sink's value scaled (``scaled`` sink, ``position`` 0),
        then one per γ with the control token's (``scaled`` control; position −1: none)."""
        sink, control = self.acc.scaling(self.model, self.ids[i], unit=i)
        position = self.acc.control_position(int(self.ids[i].numel()), i)
        rows = []
        for scaled, where, nll in (("sink", 0, sink), ("control", position, control)):
            for gamma, value in zip(self.options.gammas, nll, strict=True):
                pos = -1 if where is None else where
                rows.append(
                    {"seq": i, "gamma": gamma, "nll": value, "scaled": scaled, "position": pos}
                )
        return rows

    def phases(self) -> Iterator[Phase]:
        n = len(self.ids)
        yield Phase(
            "geometry", range(n), lambda i: self.observe(i), state=self.acc,
            state_file=STATE_FILE, load_state=load_state, write_state=save_state,
        )  # fmt: skip
        if "sink_scaling" in self.analyses and self.acc.plan_scaling():
            yield Phase(
                "sink scaling", range(n), self.scale, rows_file=SCALING_FILE, key="seq",
                rows_per_unit=2 * len(self.options.gammas),
            )  # fmt: skip

    def result(
        self, rows: Mapping[str, list[dict[str, str]]], run_info: dict[str, Any]
    ) -> GeometryResult:
        self.acc.scaling_nll, self.acc.control_nll = split_scaling_rows(rows.get(SCALING_FILE, []))
        result = self.acc.result()
        result.config, result.run_info = self.config(), run_info
        result.tokens = [int(x.numel()) for x in self.ids]
        result.state = self.acc.state_dict()
        result.scaling_rows = list(rows.get(SCALING_FILE, []))
        return result


def run_geometry(
    model: LoadedModel,
    texts: Sequence[str | Sequence[int] | Tensor],
    out: str | Path | None,
    analyses: str | Sequence[str] | None = None,
    options: GeometryOptions | None = None,
    resume: bool = False,
    progress: bool = True,
    source: str = "",
) -> GeometryResult:
    """Run the geometry analyses over ``texts`` into the run folder ``out`` (resumable;
    data parallel under ``accelerate launch``, see :mod:`..runner`)."""
    experiment = Geometry(model, texts, analyses, options, source)
    if "sink_scaling" in experiment.analyses:  # the only table with errors over texts
        warn_few_samples(len(experiment.texts), "text", "sink scaling: ppl_se, nll_se")
    return run_experiment(experiment, out, resume=resume, progress=progress)


def analyse(
    model: LoadedModel,
    texts: Iterable[str | Sequence[int] | Tensor],
    analyses: str | Iterable[str] | None = None,
    options: GeometryOptions | None = None,
    progress: bool = False,
) -> GeometryResult:
    """Run the requested analyses (default: all) over ``texts``; see the module docstring.

    :func:`run_geometry` without a run folder.
    """
    names = resolve_analyses(analyses)
    return run_geometry(model, list(texts), None, names, options, progress=progress)


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


def sink_scaling(
    model: LoadedModel, texts: Any, options: GeometryOptions | None = None
) -> SinkScalingResult:
    """Figure 6c: perplexity against γ with v_0 scaled by γ in the sink layers."""
    res = _one(model, texts, "sink_scaling", options)
    assert res.sink_scaling is not None
    return res.sink_scaling


class TableFunction(Protocol):
    """``f(model, texts, options=None)``: one analysis run on the texts (or token-id lists),
    one of its tables returned."""

    def __call__(
        self, model: LoadedModel, texts: Any, options: GeometryOptions | None = None
    ) -> pd.DataFrame: ...


#: the docstrings of the functions that return one table of an analysis as it is
_TABLE_DOCS = {
    "log_correlations": "Table 2: Pearson correlations of log α, log r, log|κ| (token group "
    "``all``).",
    "first_token_weight": "Table 4 per layer (columns attention, vw, contribution); "
    "``.mean()`` gives the overall.",
    "entropy": "Table 5: rows ``all`` / ``excluding_first``, columns attention, vw, contribution.",
    "sink_alignment": "Figure 5: per layer, mean cos(ṽ_0, ṽ_j) (``sink_tail``) and cos(ṽ_i, "
    "ṽ_j) (``tail_tail``).",
    "norm_fit": "§6.2: one row per head: γ', κ'², ‖ṽ_0‖², α_min, convexity, R².",
    "semantic_cone": "Figure 6a/b: per layer, fractions of (low-norm) head outputs inside the "
    "cone.",
    "joint_distributions": "Figure 7: sampled pairs with columns alpha, vnorm, kappa, layer, "
    "first.",
}


def _table_function(name: str, analysis: str, table: str) -> TableFunction:
    """The function ``name``: runs ``analysis`` and returns ``result.<table>``."""

    def run_one(
        model: LoadedModel, texts: Any, options: GeometryOptions | None = None
    ) -> pd.DataFrame:
        return cast(pd.DataFrame, getattr(_one(model, texts, analysis, options), table))

    run_one.__name__ = run_one.__qualname__ = name
    run_one.__doc__ = _TABLE_DOCS[name]
    return run_one


log_correlations = _table_function("log_correlations", "correlations", "correlations")
first_token_weight = _table_function(
    "first_token_weight", "first_token_weight", "first_token_weight_by_layer"
)
entropy = _table_function("entropy", "entropy", "entropy")
sink_alignment = _table_function("sink_alignment", "sink_alignment", "sink_alignment")
norm_fit = _table_function("norm_fit", "norm_fit", "norm_fit")
semantic_cone = _table_function("semantic_cone", "semantic_cone", "semantic_cone")
joint_distributions = _table_function("joint_distributions", "joint_distributions", "joint")
