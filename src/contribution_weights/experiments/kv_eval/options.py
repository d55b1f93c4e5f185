"""The options of ``cw kv-eval`` (:class:`KVEvalOptions`), the names of its tasks and
metrics, and their checks.

Light: nothing here imports torch (the methods and ratios are checked, importing
:mod:`~contribution_weights.kv`, when options are made), so ``cw kv-eval --help`` and a bad
flag answer before torch is imported. ``experiments/options.py`` re-exports
:class:`KVEvalOptions` beside the other experiments' options.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...defaults import KV_RATIOS, KV_TASKS, KV_WINDOW, RULER_SETTINGS, RULER_TASKS
from ...fields import Options, as_floats, option, split_names

TASKS = KV_TASKS
METRIC = {"lm": "nll", "passkey": "accuracy", "ruler": "accuracy"}
DEFAULT_RATIOS = KV_RATIOS
#: the method name of ratio 0: the uncompressed cache, evaluated once per item
NO_COMPRESSION = "none"


def check_ruler_tasks(tasks: Any) -> list[str]:
    """Distinct known RULER-like task names, in the order given (``all``: every task)."""
    names = split_names(tasks)
    if "all" in names:
        names = [n for n in names if n != "all"] + list(RULER_TASKS)
    unknown = [name for name in names if name not in RULER_TASKS]
    if unknown:  # all of them at once
        shown = ", ".join(repr(n) for n in unknown)
        what = "ruler task" if len(unknown) == 1 else "ruler tasks"
        raise ValueError(f"unknown {what} {shown}; choose from {', '.join(RULER_TASKS)} (or all)")
    if not names:
        raise ValueError(f"no ruler task given; choose from {', '.join(RULER_TASKS)} (or all)")
    return list(dict.fromkeys(names))


def check_settings(settings: Any) -> list[str]:
    """Known kv-eval settings in :data:`RULER_SETTINGS`' order (``both``: the two)."""
    names = split_names(settings)
    names = [s for n in names for s in (RULER_SETTINGS if n == "both" else (n,))]
    for name in names:
        if name not in RULER_SETTINGS:
            raise ValueError(
                f"unknown setting {name!r}; choose from {', '.join(RULER_SETTINGS)} or both"
            )
    if not names:
        raise ValueError(f"no setting given; choose from {', '.join(RULER_SETTINGS)} or both")
    return [s for s in RULER_SETTINGS if s in names]


@dataclass
class KVEvalOptions(Options):
    """Options shared by :func:`~.run.kv_eval` and ``cw kv-eval`` (checked on creation).

    Attributes:
        task: ``"lm"`` (NLL of the next 128 tokens), ``"passkey"`` or ``"ruler"`` (the
            long-context tasks of :mod:`~...kv.ruler`; the CLI sets it from ``--task`` or the
            data given).
        methods: ``"all"`` or names of registered KV-cache methods.
        ratios: compression ratios in [0, 1), the fraction of entries evicted (0: none).
        context_tokens: C, the tokens prefilled and compressed (ruler: the whole prompt,
            question and answer prefix included, as RULER counts its length).
        n: items per cell (ruler: per task).
        window: the observation window, the last prefill queries methods read.
        seed: passkey and ruler items, and random scores.
        ruler_tasks: ``"all"`` or names from :data:`~...defaults.RULER_TASKS` (ruler only).
        settings: ``query_agnostic`` and/or ``query_aware`` (``"both"``: the two); ruler
            only, the other tasks are query-agnostic.
    """

    task: str = option("lm", "lm, passkey or ruler", choices=KV_TASKS)
    methods: list[str] | str = option(
        "all",
        "comma-separated methods or all (docs/kv-cache.md describes them; an unknown name "
        "is answered with the list)",
        flag="--methods",
    )
    ratios: list[float] = option(
        KV_RATIOS,
        "compression ratios in [0, 1): the fraction of entries evicted; 0 = none",
        flag="--ratios", parse="floats",
    )  # fmt: skip
    context_tokens: int = option(
        512, "C: tokens prefilled and compressed (ruler: the whole prompt, question included)",
        flag="--context-tokens", parse="int",
    )  # fmt: skip
    n: int = option(32, "items per cell (ruler: per task)", flag="--n", parse="int")
    window: int = option(
        KV_WINDOW, "observation window: the last prefill queries", flag="--window", parse="int"
    )
    seed: int = option(0, "passkey and ruler items, and random scores", flag="--seed",
                       parse="int")  # fmt: skip
    ruler_tasks: list[str] | str = option(
        "all",
        f"--task ruler: comma-separated tasks ({', '.join(RULER_TASKS)}) or all; --n items of "
        "each task",
        flag="--ruler-tasks",
    )
    settings: list[str] = option(
        ("query_agnostic",),
        "--task ruler: query_agnostic (the question fed after compression), query_aware "
        "(the question prefilled, inside the observation window), or both",
        flag="--setting", parse="names",
    )  # fmt: skip

    def validate(self) -> None:
        from ...kv.cache import check_ratio  # needs torch: checked when options are made
        from ...kv.methods import resolve_methods

        if self.task not in KV_TASKS:
            raise ValueError(f"unknown task {self.task!r}; choose from {', '.join(KV_TASKS)}")
        self.settings = check_settings(self.settings)
        if self.task == "ruler":
            self.ruler_tasks = check_ruler_tasks(self.ruler_tasks)
        else:
            if set(check_ruler_tasks(self.ruler_tasks)) != set(RULER_TASKS):
                raise ValueError("--ruler-tasks applies to --task ruler only")
            self.ruler_tasks = "all"  # the default, as older run folders hold it
            if self.settings != ["query_agnostic"]:
                raise ValueError(
                    f"--setting {','.join(self.settings)} applies to --task ruler only: the "
                    "lm task asks nothing and passkey asks its question after compression"
                )
        self.methods = resolve_methods(self.methods)
        self.ratios = sorted({check_ratio(r) for r in as_floats(self.ratios)})
        if not self.ratios:
            raise ValueError("give at least one compression ratio, e.g. 0,0.5,0.9")
        for name in ("context_tokens", "n", "window"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.context_tokens < 2 * self.window:
            raise ValueError(
                f"--context-tokens {self.context_tokens} is too short for an observation "
                f"window of {self.window} queries; use at least {2 * self.window}"
            )
        if self.task == "ruler" and 0.0 not in self.ratios:
            raise ValueError(
                "--task ruler needs ratio 0 (no compression) among --ratios, so that a task "
                "the model cannot do uncompressed shows as such; e.g. --ratios 0,0.5,0.9"
            )

    def configurations(self) -> list[tuple[str, float]]:
        """(method, ratio) pairs a kv-eval item is evaluated in; ``none`` is ratio 0."""
        out = [(NO_COMPRESSION, 0.0)] if 0.0 in self.ratios else []
        return out + [(m, r) for m in self.methods for r in self.ratios if r > 0]
