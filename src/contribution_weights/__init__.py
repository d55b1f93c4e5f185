"""contribution-weights: which tokens really drive the attention layers of an LLM.

Quick start::

    import contribution_weights as cw
    model = cw.load_model()                  # SmolLM2-135M-Instruct, embedded
    trace = cw.trace(model, "Some text")     # all measures, all layers
    trace["contribution"]                    # (layers, heads, T, T) float32
    trace.summary()

Layout (arrows point one way): ``measures`` (pure maths) ← ``capture`` (getting
internals out of a model, and interventions) ← ``tracing`` / experiments ← ``results``
← ``presentation`` ← ``cli``.
"""

from . import data, kv
from .capture import CaptureError, CaptureSession, LayerCall, capturing
from .experiments import geometry
from .experiments.downstream import DownstreamResult, downstream
from .experiments.faithfulness import FaithfulnessResult, faithfulness
from .experiments.geometry import GeometryOptions, GeometryResult
from .experiments.geometry_run import run_geometry
from .families import FamilySpec, UnsupportedModelError, register_family, supported_families
from .inputs import InputError
from .loading import LoadedModel, ModelLoadError, load_model
from .measures import Measure, get_measure, measure_names, register_measure
from .results import Trace
from .tracing import TraceOptions, trace

__version__ = "0.1.0"

__all__ = [
    "CaptureError",
    "CaptureSession",
    "DownstreamResult",
    "FaithfulnessResult",
    "FamilySpec",
    "GeometryOptions",
    "GeometryResult",
    "InputError",
    "LayerCall",
    "LoadedModel",
    "Measure",
    "ModelLoadError",
    "Trace",
    "TraceOptions",
    "UnsupportedModelError",
    "__version__",
    "capturing",
    "data",
    "downstream",
    "faithfulness",
    "geometry",
    "get_measure",
    "kv",
    "load_model",
    "measure_names",
    "register_family",
    "register_measure",
    "run_geometry",
    "supported_families",
    "trace",
]
