"""contribution-weights: which tokens really drive the attention layers of an LLM.

Quick start::

    import contribution_weights as cw
    model = cw.load_model()                  # SmolLM2-135M-Instruct, embedded
    trace = cw.trace(model, "Some text")     # all measures, all layers
    trace["contribution"][5, 2]              # layer position 5, head 2: (T, T) float32
    cw.trace(model, long_text, out="runs/x") # maps streamed to disk, read back lazily
    trace.summary()

Layout: each layer imports only from the layers before it (checked, lazy imports inside
functions included, by ``tests/test_layering.py``):

0. ``registry`` (the one registry type for everything found by name), ``defaults``
   (the names and defaults the command line shows) and ``generated`` (the docs' tables
   copied from run folders): pure Python, they import nothing;
1. ``measures`` (pure maths), ``families`` (model families as data), ``runs`` (run
   folders), ``data`` (evaluation data), ``progress``, ``tracing.storage`` (where a
   trace's maps live: memory or per-layer shards on disk), ``tracing.folder`` (one
   writer per trace folder, staged writes, checksums);
2. ``capture`` (getting internals out of a model), ``loading`` (models), and the trace
   result: ``tracing.maps``, ``tracing.format`` (the folder), ``tracing.query`` (one
   query's top tokens, the sink verdict), ``tracing.result`` (``Trace``);
3. ``interventions`` (every intervention, and running them as batched forwards),
   ``inputs`` (encoding texts, resolving layers), ``kv`` (KV-cache compression);
4. ``tracing`` (options, preflight, recorder, ``trace()``), ``experiments``
   (faithfulness, downstream, geometry, kv-eval, attribution-eval on one runner) and
   ``attribution`` (end-to-end attribution: contribution flow and its baselines);
5. ``presentation`` (figures, Markdown, the HTML report);
6. ``cli``, then this package's ``__init__`` and ``__main__``.

A package split over layers (``tracing``) is checked module by module; inside it a module
imports only modules of its own layer or below.

No module imports a higher layer, not even lazily inside a function: results know
nothing of their figures. The figures register themselves by result type
(``presentation.figures.register_figure``; geometry's by analysis name,
``presentation.geometry_plots.register_geometry_figure``) and ``cw.plot(result)`` draws one;
``cw.write_report(trace)`` writes a trace's report, and in Jupyter a trace displays as
that report (this ``__init__`` registers the display with IPython by type name).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import progress  # noqa: F401  (first: quiets tqdm's notebook warning; light)

if TYPE_CHECKING:  # what the names below resolve to, for type checkers and IDEs
    from . import data, kv
    from .attribution.methods import AttributionMethod, register_attribution_method
    from .attribution.options import AttributeOptions
    from .attribution.result import Attribution
    from .attribution.run import attribute
    from .attribution.targets import Target, TargetError
    from .capture import CaptureError, CaptureSession, LayerCall, capturing
    from .experiments import geometry
    from .experiments.attribution_eval import AttributionEvalResult, attribution_eval
    from .experiments.downstream import DownstreamOptions, DownstreamResult, downstream
    from .experiments.faithfulness import (
        FaithfulnessOptions,
        FaithfulnessResult,
        faithfulness,
    )
    from .experiments.geometry import GeometryOptions, GeometryResult, run_geometry
    from .families import FamilySpec, UnsupportedModelError, register_family, supported_families
    from .inputs import InputError
    from .loading import LoadedModel, ModelLoadError, load_model
    from .measures import Measure, get_measure, measure_names, register_measure
    from .presentation.figures import plot, register_figure
    from .presentation.report import write_report
    from .tracing import TraceOptions, trace
    from .tracing.result import Trace

#: where each public name lives. The package imports nothing heavy (torch, transformers)
#: itself: a name's module is imported when the name is first used (PEP 562), so ``cw
#: --help`` and argument errors answer at once, and ``import contribution_weights`` is quick.
_EXPORTS: dict[str, str] = {
    "CaptureError": ".capture",
    "CaptureSession": ".capture",
    "LayerCall": ".capture",
    "capturing": ".capture",
    "DownstreamOptions": ".experiments.downstream",
    "DownstreamResult": ".experiments.downstream",
    "downstream": ".experiments.downstream",
    "FaithfulnessOptions": ".experiments.faithfulness",
    "FaithfulnessResult": ".experiments.faithfulness",
    "faithfulness": ".experiments.faithfulness",
    "GeometryOptions": ".experiments.geometry",
    "GeometryResult": ".experiments.geometry",
    "run_geometry": ".experiments.geometry",
    "FamilySpec": ".families",
    "UnsupportedModelError": ".families",
    "register_family": ".families",
    "supported_families": ".families",
    "InputError": ".inputs",
    "LoadedModel": ".loading",
    "ModelLoadError": ".loading",
    "load_model": ".loading",
    "Measure": ".measures",
    "get_measure": ".measures",
    "measure_names": ".measures",
    "register_measure": ".measures",
    "Trace": ".tracing",
    "plot": ".presentation.figures",
    "register_figure": ".presentation.figures",
    "write_report": ".presentation.report",
    "TraceOptions": ".tracing",
    "trace": ".tracing",
    "attribute": ".attribution.run",
    "Attribution": ".attribution.result",
    "AttributeOptions": ".attribution.options",
    "AttributionMethod": ".attribution.methods",
    "register_attribution_method": ".attribution.methods",
    "Target": ".attribution.targets",
    "TargetError": ".attribution.targets",
    "attribution_eval": ".experiments.attribution_eval",
    "AttributionEvalResult": ".experiments.attribution_eval",
}
_MODULES = {"data": ".data", "kv": ".kv", "geometry": ".experiments.geometry"}

__version__ = "0.1.0"

__all__ = [
    "AttributeOptions",
    "Attribution",
    "AttributionEvalResult",
    "AttributionMethod",
    "CaptureError",
    "CaptureSession",
    "DownstreamOptions",
    "DownstreamResult",
    "FaithfulnessOptions",
    "FaithfulnessResult",
    "FamilySpec",
    "GeometryOptions",
    "GeometryResult",
    "InputError",
    "LayerCall",
    "LoadedModel",
    "Measure",
    "ModelLoadError",
    "Target",
    "TargetError",
    "Trace",
    "TraceOptions",
    "UnsupportedModelError",
    "__version__",
    "attribute",
    "attribution_eval",
    "capturing",
    "data",
    "downstream",
    "faithfulness",
    "geometry",
    "get_measure",
    "kv",
    "load_model",
    "measure_names",
    "plot",
    "register_attribution_method",
    "register_family",
    "register_figure",
    "register_measure",
    "run_geometry",
    "supported_families",
    "trace",
    "write_report",
]


def __getattr__(name: str) -> Any:
    """The public names, imported on first use; also the package's submodules
    (``cw.tracing``, ``cw.measures``), as an eager ``__init__`` would have left them."""
    if name in _MODULES:
        value: Any = importlib.import_module(_MODULES[name], __name__)
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    else:
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def _trace_html(trace: Any) -> str:
    """A trace in Jupyter: the interactive report, compact, inside the notebook."""
    from .presentation.report import notebook_html

    return notebook_html(trace)


def _show_traces_in_notebooks() -> None:
    """In IPython, display a ``Trace`` as its report. Registered by the type's name, so
    nothing is imported until a trace is shown; outside IPython this does nothing."""
    import sys

    if "IPython" not in sys.modules:
        return
    shell = sys.modules["IPython"].get_ipython()
    if shell is not None:
        html = shell.display_formatter.formatters["text/html"]
        html.for_type_by_name("contribution_weights.tracing.result", "Trace", _trace_html)


_show_traces_in_notebooks()
