"""Every intervention, and running them as batched forwards: token removal (method §4),
sink-value scaling (method §5), and rows of configurations as one forward pass each.

An intervention changes a model's attention through the one hook point of
:mod:`~..capture`: the registered attention function asks the session's
:class:`~..capture.Intervention` once per layer for multipliers of the attention columns
``(B, H, T_k)`` (0 removes a token's projected value from every query). Batch rows are
configurations, so every configuration of one sequence runs in a single forward.

The pieces, each importing only those before it:

* :mod:`.sinks`: which tokens are sinks (:func:`sink_mask`), recorded for every
  decoder layer as the forward goes by :func:`tracking_sinks`, whose pre-hooks live only
  inside its ``with`` block, into the :class:`SinkTracker` it yields; and
  :class:`SinkValueScale`, the intervention scaling v_0 by γ per batch row.
* :mod:`.removal`: what one row removes (:class:`Removal`, :data:`CLEAN` for nothing) and
  the intervention that removes it, :class:`SequentialRemoval`, which ranks tokens per
  (layer, head) on that layer's already-intervened activations and reads the sinks of
  the same forward from a :class:`SinkTracker`. It lives for one forward (one chunk of
  rows); with ``keep_history`` it keeps a :class:`LayerRecord` per layer.
  :func:`global_thresholds` runs one clean probe forward to turn the rates of the global
  scope into score thresholds, once per sequence, before the removal forwards.
* :mod:`.batching`: :func:`intervened_logprobs` runs rows of token ids under any
  intervention, chunked to fit a memory budget (:func:`auto_batch_size`) and halved on
  out-of-memory. The intervention is asked for per chunk as a context manager
  (:data:`InterventionFor`) entered around that chunk's forward only, so the
  intervention and whatever it holds (hooks, a sink tracker) live exactly as long as
  that forward. :func:`token_logprobs` is it with one :class:`Removal` per row, and
  :func:`mean_nll` turns log-probabilities into a per-row mean NLL.

Every public name is importable from this package (``from ..interventions import
token_logprobs``); a test that replaces a name must patch the module that looks it up
(``interventions.removal.column_sums_of``, ``interventions.batching._forward``).
"""

from ..defaults import INTERVENTIONS, MODES, SCOPES, SINK_COSINE  # light: the CLI shows them
from .batching import (
    DEFAULT_MEMORY_BYTES,
    InterventionFor,
    auto_batch_size,
    intervened_logprobs,
    mean_nll,
    row_bytes,
    token_logprobs,
)
from .removal import (
    CLEAN,
    LayerRecord,
    Removal,
    SequentialRemoval,
    column_sums_of,
    global_thresholds,
    removal_count,
    sequence_salt,
)
from .sinks import SinkTracker, SinkValueScale, sink_mask, tracking_sinks

__all__ = [
    "CLEAN",
    "DEFAULT_MEMORY_BYTES",
    "INTERVENTIONS",
    "MODES",
    "SCOPES",
    "SINK_COSINE",
    "InterventionFor",
    "LayerRecord",
    "Removal",
    "SequentialRemoval",
    "SinkTracker",
    "SinkValueScale",
    "auto_batch_size",
    "column_sums_of",
    "global_thresholds",
    "intervened_logprobs",
    "mean_nll",
    "removal_count",
    "row_bytes",
    "sequence_salt",
    "sink_mask",
    "token_logprobs",
    "tracking_sinks",
]
