"""KV-cache compression by contribution, next to the methods practitioners use.

After a prefill, every cached key/value of each layer and KV head gets a score from a
named method; the lowest-scored fraction (the compression ratio, as kvpress defines it) is
evicted, and generation continues on the compressed cache::

    import contribution_weights as cw
    model = cw.load_model()
    ids = cw.inputs.encode(model, text)
    pre = cw.kv.prefill(model, ids)                     # one capture pass, all methods
    small = cw.kv.compress(pre, "contribution_sinks", 0.5)
    out = small.forward(model.model, next_ids)          # positions continue at T
    new = small.generate(model.model, next_ids, max_new_tokens=20)

Modules: :mod:`.methods` (the registry, pure maths on per-layer statistics),
:mod:`.scoring` (the prefill on the capture path), :mod:`.cache` (eviction and positions),
:mod:`.evaluate` (the language-modelling and passkey tasks behind ``cw kv-eval``).
"""

from .cache import CompressedCache, check_ratio, compress, kept_positions, n_kept
from .methods import (
    LayerStats,
    Method,
    get_method,
    method_names,
    register_method,
    resolve_methods,
)
from .scoring import Prefill, StatsObserver, compressible_layers, prefill

__all__ = [
    "CompressedCache",
    "LayerStats",
    "Method",
    "Prefill",
    "StatsObserver",
    "check_ratio",
    "compress",
    "compressible_layers",
    "get_method",
    "kept_positions",
    "method_names",
    "n_kept",
    "prefill",
    "register_method",
    "resolve_methods",
]
