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

A method is a frozen dataclass with its parameters as fields (``cw.kv.SnapKV(name="snapkv32",
window=32)``); register one with :func:`register_method`, or pass the instance itself to
:func:`prefill` (``methods=[...]``: gather only what they need) and :func:`compress`.

Modules: :mod:`.methods` (the registry, pure maths on per-layer statistics),
:mod:`.renormalised` (the exact change of a head's output when a key is evicted),
:mod:`.scoring` (the prefill on the capture path), :mod:`.cache` (eviction and positions),
:mod:`.heads` (the per-head mask of a cache whose heads keep different counts),
:mod:`.evaluate` (the language-modelling and passkey tasks behind ``cw kv-eval``).
"""

from .cache import CompressedCache, check_ratio, compress, kept_positions, n_kept
from .methods import (
    H2O,
    METHODS,
    TOVA,
    VATP,
    AdaKV,
    Contribution,
    CriticalKV,
    ExpectedAttention,
    H2ORecent,
    KeyDiff,
    KNorm,
    LayerStats,
    Method,
    ObservedAttention,
    Random,
    Renormalised,
    SnapKV,
    StreamingLLM,
    VATPProjected,
    WindowAttention,
    get_method,
    method_names,
    register_method,
    resolve_methods,
)
from .renormalised import renormalised_effect
from .scoring import Prefill, StatsObserver, compressible_layers, prefill

__all__ = [
    "H2O",
    "METHODS",
    "TOVA",
    "VATP",
    "AdaKV",
    "CompressedCache",
    "Contribution",
    "CriticalKV",
    "ExpectedAttention",
    "H2ORecent",
    "KNorm",
    "KeyDiff",
    "LayerStats",
    "Method",
    "ObservedAttention",
    "Prefill",
    "Random",
    "Renormalised",
    "SnapKV",
    "StatsObserver",
    "StreamingLLM",
    "VATPProjected",
    "WindowAttention",
    "check_ratio",
    "compress",
    "compressible_layers",
    "get_method",
    "kept_positions",
    "method_names",
    "n_kept",
    "prefill",
    "register_method",
    "renormalised_effect",
    "resolve_methods",
]
