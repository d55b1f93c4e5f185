"""Value geometry and attention sinks (paper §6 and appendix D; method §3, §5), for any model.

``cw.geometry`` is this package::

    cw.geometry.analyse(model, texts)                  # every analysis, one pass per text
    cw.geometry.norm_fit(model, texts)                 # one analysis (one function each)
    cw.run_geometry(model, texts, "runs/x")            # a resumable run folder
    cw.GeometryResult.load("runs/x").tables["norm_fit"]

Layout:

* :mod:`.analysis` — what an analysis is (:class:`Analysis`; :class:`LayerMeansAnalysis`
  for one whose table is a per-layer mean statistic), the registry
  (:func:`register_analysis`) and :func:`make_stats`;
* :mod:`.analyses` — the built-in analyses, one module each (``regression``,
  ``correlations``, ``first_token_weight``, ``entropy``, ``sink_alignment``,
  ``sink_scaling``, ``norm_fit``, ``semantic_cone``, ``joint_distributions``), each with
  the statistic only it needs, its table, ``tables.json`` entries and Markdown section;
* :mod:`.analysis_types` — the types the analyses and the result share: the context an
  analysis builds from (:class:`TableContext`), a saved run (:class:`SavedRun`) and what
  its Markdown reads of the result (:class:`ResultView`); it imports neither;
* :mod:`.result` — :class:`GeometryResult` (``tables`` by analysis name), its files,
  save and load;
* :mod:`.run` — the accumulator, the :class:`Geometry` experiment, :func:`run_geometry`,
  :func:`analyse` and the one-analysis functions.

Statistics shared by several analyses are in :mod:`..stats`; reservoir sampling and
running moments in :mod:`..sampling`. Figures and ``tables.md`` are drawn by the
presentation layer (``presentation.geometry_plots``), where each analysis' figure is
registered by its name; nothing here imports it.

A new analysis is one class: subclass :class:`Analysis`, :func:`register_analysis` an
instance, and ``cw geometry --only NAME`` runs it (``docs/geometry.md``).
"""

from __future__ import annotations

from ..options import DEFAULT_GAMMAS, GeometryOptions
from .analyses import ANALYSES, JSON_KEYS
from .analyses.correlations import Correlations
from .analyses.entropy import EntropyAnalysis
from .analyses.first_token_weight import FirstTokenWeightAnalysis
from .analyses.joint_distributions import JointDistributions
from .analyses.norm_fit import NormFitAnalysis, norm_fit_summary
from .analyses.regression import Regression
from .analyses.semantic_cone import SemanticConeAnalysis
from .analyses.sink_alignment import SinkAlignmentAnalysis
from .analyses.sink_scaling import SCALING_COLUMNS, SinkScaling, SinkScalingResult
from .analysis import (
    ANALYSES_REGISTRY,
    Analysis,
    LayerMeansAnalysis,
    analysis_names,
    get_analysis,
    make_stats,
    register_analysis,
    resolve_analyses,
)
from .analysis_types import ResultView, SavedRun, TableContext
from .result import SCALING_FILE, STATE_FILE, GeometryResult, build_result
from .run import (
    Geometry,
    GeometryAccumulator,
    NoSinkLayersWarning,
    analyse,
    component_regression,
    encode_texts,
    entropy,
    first_token_weight,
    joint_distributions,
    log_correlations,
    norm_fit,
    run_geometry,
    semantic_cone,
    sink_alignment,
    sink_scaling,
)

__all__ = [
    "ANALYSES",
    "ANALYSES_REGISTRY",
    "DEFAULT_GAMMAS",
    "JSON_KEYS",
    "SCALING_COLUMNS",
    "SCALING_FILE",
    "STATE_FILE",
    "Analysis",
    "Correlations",
    "EntropyAnalysis",
    "FirstTokenWeightAnalysis",
    "Geometry",
    "GeometryAccumulator",
    "GeometryOptions",
    "GeometryResult",
    "JointDistributions",
    "LayerMeansAnalysis",
    "NoSinkLayersWarning",
    "NormFitAnalysis",
    "Regression",
    "ResultView",
    "SavedRun",
    "SemanticConeAnalysis",
    "SinkAlignmentAnalysis",
    "SinkScaling",
    "SinkScalingResult",
    "TableContext",
    "analyse",
    "analysis_names",
    "build_result",
    "component_regression",
    "encode_texts",
    "entropy",
    "first_token_weight",
    "get_analysis",
    "joint_distributions",
    "log_correlations",
    "make_stats",
    "norm_fit",
    "norm_fit_summary",
    "register_analysis",
    "resolve_analyses",
    "run_geometry",
    "semantic_cone",
    "sink_alignment",
    "sink_scaling",
]
