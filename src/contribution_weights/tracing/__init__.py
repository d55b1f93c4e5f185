"""Tracing: one forward pass that records per-layer, per-head measures, and its result.

The pieces, in the order data flows through them:

* :mod:`.options`: :class:`TraceOptions`, declared once for :func:`trace` and ``cw trace``;
* :mod:`.preflight`: the memory and disk estimate that refuses a trace that would not fit;
* :mod:`.run`: :func:`trace`, which runs the forward under capture with a
  :class:`~.recorder.TraceRecorder` observer;
* :mod:`.recorder`: per layer and block of queries, the stored maps into the map store,
  the reductions, the per-layer vectors;
* :mod:`.storage`: where the maps live (:class:`MapStore`: memory, or packed shards on
  disk written as they are computed);
* :mod:`.result`: :class:`Trace`, what a trace returns (maps read on demand through
  :mod:`.maps`, reductions, tokens, save/load);
* :mod:`.format`: the folder a trace is saved to, read back without knowing ``Trace``;
* :mod:`.folder`: how it is written (one writer, staged, moved into place when complete)
  and checked (per-file checksums, :func:`verify`).

The storage, the map view, the folder format and the result sit low in the package's
layering (they know nothing of models); the preflight, the recorder and the run sit
above capture and inputs. Names are imported from their modules when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

if TYPE_CHECKING:
    from .folder import TraceFolderBusy, verify
    from .format import read_folder, trace_files
    from .maps import MeasureMap
    from .options import TraceOptions
    from .preflight import MemoryPlan, MemoryPreflightError, available_memory, plan_memory
    from .recorder import TraceRecorder
    from .result import Trace
    from .run import trace
    from .storage import DenseMaps, MapStore, PackedMaps, TraceFileError

_EXPORTS = {
    "TraceFolderBusy": ".folder",
    "verify": ".folder",
    "read_folder": ".format",
    "trace_files": ".format",
    "MeasureMap": ".maps",
    "TraceOptions": ".options",
    "MemoryPlan": ".preflight",
    "MemoryPreflightError": ".preflight",
    "available_memory": ".preflight",
    "plan_memory": ".preflight",
    "TraceRecorder": ".recorder",
    "Trace": ".result",
    "trace": ".run",
    "DenseMaps": ".storage",
    "MapStore": ".storage",
    "PackedMaps": ".storage",
    "TraceFileError": ".storage",
}

__all__ = [
    "DenseMaps",
    "MapStore",
    "MeasureMap",
    "MemoryPlan",
    "MemoryPreflightError",
    "PackedMaps",
    "Trace",
    "TraceFileError",
    "TraceFolderBusy",
    "TraceOptions",
    "TraceRecorder",
    "available_memory",
    "plan_memory",
    "read_folder",
    "trace",
    "trace_files",
    "verify",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
