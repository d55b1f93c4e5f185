"""The options of ``attribution-eval`` (:class:`AttributionEvalOptions`).

Pure Python, as :mod:`..options` is: ``cw attribution-eval --help`` and a bad flag
answer before torch is imported (the package's ``__init__`` imports only this module
eagerly). Checking the methods imports the attribution registry, when options are made.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...defaults import (
    ATTRIBUTION_GENERATORS,
    ATTRIBUTION_INTERVENTIONS,
    ATTRIBUTION_METHODS,
    ATTRIBUTION_RATES,
    ATTRIBUTION_TASKS,
)
from ...fields import Options, option, split_names
from ..options import check_baselines, check_rates, with_baselines


@dataclass
class AttributionEvalOptions(Options):
    """Options of :func:`~.run.attribution_eval` and ``cw attribution-eval``.

    Attributes:
        task: ``deletion`` (natural texts: deletion and insertion curves) or a known-answer
            task, ``induction``, ``lookup``, ``passkey`` (the CLI sets it from ``--task`` or
            the data given).
        n: items generated (known-answer tasks) or texts used (deletion).
        tokens: the items' length in tokens.
        methods: attribution methods compared (registered names, or all).
        added_methods: methods added to a run after it was made (``--add-methods`` with
            ``--resume``): each runs on the run's items in a phase of its own, its rows in
            ``added-{method}.csv``, and joins the others in every table; the run's own
            rows are not recomputed.
        baselines: rankings that need no method: random (``random_seeds`` seeds), recency.
        rates: the shares of candidate tokens removed (or kept, for insertion).
        interventions: how a removed token leaves the input: ``key_mask`` (its key leaves
            the softmax of every head in every layer) and ``embedding`` (its input embedding
            is replaced by the mean embedding of the vocabulary).
        steps: integrated gradients' steps.
        protect_first: never remove token 0 (the usual attention sink).
        seed: items and random rankings.
        generator: how known-answer items are built: ``words`` (the task families the
            methods were chosen on) or ``fresh`` (the seed draws the vocabulary range,
            lengths, separators and phrasing anew: :mod:`~...attribution.tasks`).
    """

    task: str = option("induction", "the task", choices=ATTRIBUTION_TASKS)
    n: int = option(64, "items (known-answer tasks) or texts (deletion)", flag="--n", parse="int")
    tokens: int = option(64, "tokens per item", flag="--tokens", parse="int")
    methods: list[str] = option(
        ATTRIBUTION_METHODS, "attribution methods, comma-separated or all",
        flag="--methods", parse="names",
    )  # fmt: skip
    added_methods: list[str] = option(
        (), "with --resume: methods to add to the run in --out (finished or not), scored on "
        "its items beside its own methods without recomputing them", flag="--add-methods",
        parse="names",
    )  # fmt: skip
    baselines: list[str] = option(
        ("random", "recency"), "random (seeded, --random-seeds of them), recency (latest "
        "first), or none", flag="--baselines", parse="names",
    )  # fmt: skip
    random_seeds: int = option(3, "seeds of the random baseline", flag="--random-seeds",
                               parse="int")  # fmt: skip
    rates: list[float] = option(
        ATTRIBUTION_RATES, "shares of candidate tokens removed (insertion: kept)",
        flag="--rates", parse="floats",
    )  # fmt: skip
    interventions: list[str] = option(
        ATTRIBUTION_INTERVENTIONS, "key_mask (out of every softmax) and/or embedding "
        "(replaced by the mean embedding)", flag="--interventions", parse="names",
    )  # fmt: skip
    steps: int = option(50, "integrated gradients: steps", flag="--steps", parse="int")
    protect_first: bool = option(True, "let token 0 (the usual sink) be removed too",
                                 flag="--no-sink-protection", parse="no-flag")  # fmt: skip
    seed: int = option(0, "items and random rankings", flag="--seed", parse="int")
    generator: str = option(
        "words", "known-answer items: words (the tuned families) or fresh (the seed draws "
        "token range, lengths, separators and phrasing)", flag="--generator",
        choices=ATTRIBUTION_GENERATORS,
    )  # fmt: skip

    def validate(self) -> None:
        from ...attribution.methods import METHODS

        if self.task not in ATTRIBUTION_TASKS:
            raise ValueError(
                f"unknown task {self.task!r}; choose from {', '.join(ATTRIBUTION_TASKS)}"
            )
        if int(self.n) < 1:
            raise ValueError(f"--n must be at least 1, got {self.n}")
        if int(self.tokens) < 16:
            raise ValueError(f"--tokens must be at least 16, got {self.tokens}")
        self.n, self.tokens, self.steps = int(self.n), int(self.tokens), int(self.steps)
        self.methods = METHODS.resolve(split_names(self.methods))
        if not self.methods:
            raise ValueError("no attribution method given; e.g. --methods flow,input_x_gradient")
        added = split_names(self.added_methods)
        self.added_methods = METHODS.resolve(added) if added else []
        twice = [m for m in self.added_methods if m in self.methods]
        if twice:
            raise ValueError(
                f"--add-methods {','.join(twice)}: already among --methods "
                f"({','.join(self.methods)}); add only methods the run does not have"
            )
        self.baselines, self.random_seeds = check_baselines(self.baselines, self.random_seeds)
        self.rates = check_rates(self.rates)
        if not self.rates or min(self.rates) <= 0 or max(self.rates) >= 1:
            raise ValueError("--rates must lie strictly between 0 and 1, e.g. 0.1,0.2,0.5")
        self.interventions = list(dict.fromkeys(split_names(self.interventions)))
        for how in self.interventions:
            if how not in ATTRIBUTION_INTERVENTIONS:
                raise ValueError(
                    f"unknown intervention {how!r}; choose from "
                    f"{', '.join(ATTRIBUTION_INTERVENTIONS)}"
                )
        if not self.interventions:
            raise ValueError("no intervention given; e.g. --interventions key_mask")
        if self.steps < 1:
            raise ValueError(f"--steps must be at least 1, got {self.steps}")
        self.protect_first = bool(self.protect_first)
        if self.generator not in ATTRIBUTION_GENERATORS:
            raise ValueError(
                f"unknown generator {self.generator!r}; choose from "
                f"{', '.join(ATTRIBUTION_GENERATORS)}"
            )
        if self.generator == "fresh" and self.task == "deletion":
            raise ValueError(
                "--generator fresh builds known-answer items; the deletion task reads texts "
                "(--dataset or --texts): drop --generator or choose --task induction"
            )

    def rankings(self) -> list[str]:
        """The methods, then the baselines (``random:SEED`` per seed)."""
        return with_baselines(self.methods, self.baselines, self.random_seeds)
