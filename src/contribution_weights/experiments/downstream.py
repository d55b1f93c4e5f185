"""Faithfulness on downstream tasks (method §4, paper Figure 4).

Each :class:`~..data.ChoiceItem` is scored by the log-likelihood of each option after
the prompt: the option with the highest summed log-probability of its tokens is the
model's answer. Under sufficiency removal at rate p, the bottom ⌈p·N⌉ eligible *prompt*
tokens are removed per (layer, head) (token scores average over the prompt's queries
only, so the removal is the same whatever option follows). All (configuration, option)
rows of one item run as one batched forward, options right-padded (padding comes after
every scored token, so causal attention never sees it).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from ..attribution.flow import end_to_end_scores
from ..data import ChoiceItem
from ..defaults import BASELINES
from ..interventions import (
    CLEAN,
    DEFAULT_MEMORY_BYTES,
    SINK_COSINE,
    Removal,
    sequence_salt,
    token_logprobs,
)
from ..loading import LoadedModel
from ..runs import fingerprint, renamed_keyword
from .options import (  # the options are light: the CLI reads them before torch
    DEFAULT_MEASURES,
    DEFAULT_RATES,
    DownstreamOptions,
    as_floats,
    split_names,
)
from .paired import OUTCOMES, REFERENCE, holm, mcnemar_table
from .result import SUMMARY as SUMMARY  # re-exported: the summary file
from .result import RowsResult, rows_named, typed_frame, write_csv
from .runner import Experiment, Phase, SkipUnit, run_experiment

PER_ITEM = "per_item.csv"
PAIRED = "summary_paired.csv"  # the reference against every other ranking (.paired)
SUMMARY_COLUMNS = [
    "task", "measure", "rate", "n", "accuracy", "clean_accuracy",
    "accuracy_lo", "accuracy_hi", "clean_lo", "clean_hi", "chance", "p_vs_clean",
    "p_vs_clean_holm", "p_vs_chance", "changed",
]  # fmt: skip
#: two-sided 95% normal quantile of the Wilson intervals
Z95 = 1.959963984540054


def wilson_interval(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion ``k/n`` (95% by default)."""
    if n < 1:
        return math.nan, math.nan
    p, z2 = k / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    # rounding can put a bound a hair past k/n at k = 0 or n; the interval holds the estimate
    return max(0.0, min(centre - half, p)), min(1.0, max(centre + half, p))


def binomial_test(k: int, n: int, p: float) -> float:
    """Exact two-sided binomial test of ``k`` successes in ``n`` trials against rate ``p``:
    the probability of an outcome no more likely than ``k`` (1 when ``n`` is 0)."""
    if n == 0:
        return 1.0
    if p <= 0 or p >= 1:
        return float(k == round(p * n))

    def log_pmf(i: int) -> float:
        return (
            math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1)
            + i * math.log(p) + (n - i) * math.log1p(-p)
        )  # fmt: skip

    observed = log_pmf(k) + 1e-7  # outcomes equally likely up to rounding count as extreme
    return min(1.0, sum(math.exp(v) for i in range(n + 1) if (v := log_pmf(i)) <= observed))


def encode_item(model: LoadedModel, item: ChoiceItem) -> tuple[list[int], list[list[int]]]:
    """Prompt ids (with the tokenizer's special tokens) and each option's ids (without)."""
    prompt = list(model.tokenizer(item.prompt, add_special_tokens=True)["input_ids"])
    options = [
        list(model.tokenizer(o, add_special_tokens=False)["input_ids"]) for o in item.options
    ]
    if not prompt or any(not o for o in options):
        raise ValueError(f"empty prompt or option after tokenisation: {item!r}")
    return prompt, options


def option_scores(
    model: LoadedModel,
    prompt: Sequence[int],
    options: Sequence[Sequence[int]],
    removals: Sequence[Removal],
    *,
    protect_sinks: bool = True,
    sink_cosine: float = SINK_COSINE,
    batch_size: int | None = None,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    how: str = "value_zero",
) -> torch.Tensor:
    """``(len(removals), len(options))`` summed log-probability of each option's tokens.

    When every option is one token (MMLU's letters, BoolQ's yes/no) each configuration
    runs once on the prompt alone and reads all options from its next-token
    distribution; otherwise each (configuration, option) pair is a row.
    """
    p = len(prompt)
    salt = sequence_salt(prompt)
    # the end-to-end rankings read the prompt alone, whatever option follows it
    fixed = end_to_end_scores(model, torch.tensor(list(prompt)), [r.measure for r in removals])

    def logprobs(ids: torch.Tensor, rows: list[Removal], last: bool = False) -> torch.Tensor:
        return token_logprobs(
            model,
            ids,
            rows,
            eligible_len=p,
            protect_sinks=protect_sinks,
            sink_cosine=sink_cosine,
            batch_size=batch_size,
            memory_bytes=memory_bytes,
            last=last,
            how=how,
            salt=salt,  # one random ranking per item, whatever option follows the prompt
            fixed_scores=fixed,
        )

    if all(len(o) == 1 for o in options):
        ids = torch.tensor([list(prompt)], dtype=torch.long).expand(len(removals), -1)
        logp = logprobs(ids, list(removals), last=True)
        return logp[:, [o[0] for o in options]].double()
    width = p + max(len(o) for o in options)
    rows = len(removals) * len(options)
    pad = int(prompt[0])
    ids = torch.full((rows, width), pad, dtype=torch.long)
    row_removals = []
    for r, (removal, choice) in enumerate(itertools.product(removals, options)):
        seq = [*prompt, *choice]
        ids[r, : len(seq)] = torch.tensor(seq)
        row_removals.append(removal)
    logp = logprobs(ids, row_removals)
    scores = torch.empty(rows, dtype=torch.float64)
    for r, (_, choice) in enumerate(itertools.product(removals, options)):
        # log p of option token k sits at position p - 1 + k of the shifted targets
        scores[r] = logp[r, p - 1 : p - 1 + len(choice)].double().sum()
    return scores.reshape(len(removals), len(options))


def pick(scores: torch.Tensor) -> torch.Tensor:
    """Index of the best option per row (first one on ties)."""
    return scores.argmax(dim=-1)


def summarise(per_item: pd.DataFrame, task: str) -> pd.DataFrame:
    """Accuracy per (measure, rate) with its 95% Wilson interval, the clean accuracy with
    its interval, chance (the mean of 1/options over items), the exact McNemar p-value
    of the paired difference from clean (items flipped each way), the same Holm-corrected
    over every row of the table (``p_vs_clean_holm``: the task's rankings × rates) and the
    exact binomial p-value against chance; ``changed`` is the fraction of items whose
    answer differs from the clean one (informative even when accuracy cannot move, e.g. a
    model at chance)."""
    if per_item.empty:
        return pd.DataFrame(columns=SUMMARY_COLUMNS)
    items = per_item.drop_duplicates("item")
    n_clean, k_clean = len(items), int(items["clean_correct"].sum())
    clean = k_clean / n_clean
    if "n_options" in items:
        chance = float((1.0 / items["n_options"].astype(float)).mean())
    else:
        chance = math.nan  # runs from before the option count was recorded
    rows = []
    for (measure, rate), g in per_item.groupby(["measure", "rate"], sort=False):
        n, k = len(g), int(g["correct"].sum())
        lost = int(((g["clean_correct"] == 1) & (g["correct"] == 0)).sum())
        gained = int(((g["clean_correct"] == 0) & (g["correct"] == 1)).sum())
        p_chance = math.nan if math.isnan(chance) else binomial_test(k, n, chance)
        rows.append([
            task, measure, float(rate), n, k / n, clean,
            *wilson_interval(k, n), *wilson_interval(k_clean, n_clean), chance,
            binomial_test(lost, lost + gained, 0.5), math.nan, p_chance,
            float((g["pick"] != g["clean_pick"]).mean()),
        ])  # fmt: skip
    table = pd.DataFrame(rows, columns=SUMMARY_COLUMNS)
    table["p_vs_clean_holm"] = holm(table["p_vs_clean"].to_numpy(float))
    return table


class DownstreamResult(RowsResult):
    """Per-item rows, their accuracy summary, the run's configuration and run_info."""

    ROWS = PER_ITEM

    per_item = rows_named("One row per (item, measure, rate): the item's pick and its clean pick.")

    def summarise_rows(self) -> pd.DataFrame:
        return summarise(self.rows, str(self.config.get("task", "task")))

    def paired(
        self, reference: str = REFERENCE, outcomes: Sequence[str] = tuple(OUTCOMES)
    ) -> pd.DataFrame:
        """Exact McNemar tests of the reference against every other ranking per rate, for
        each outcome (``correct``: accuracy; ``changed``: answers changed from clean),
        Holm-corrected per outcome over rates × others (:func:`.paired.mcnemar_table`)."""
        task = str(self.config.get("task", "task"))
        tables = [mcnemar_table(self.rows, reference, o) for o in outcomes]
        table = pd.concat([t for t in tables if not t.empty] or tables[:1])
        table.insert(0, "task", task)
        return table.reset_index(drop=True)

    def write_statistics(self, folder: str | Path) -> None:
        """Write ``summary_paired.csv`` into ``folder`` when the reference (IHC) was run
        (nothing else is touched)."""
        if not self.rows.empty and REFERENCE in set(self.rows["measure"]):
            write_csv(Path(folder) / PAIRED, self.paired())

    def write_summary(self, folder: Path) -> None:
        super().write_summary(folder)
        self.write_statistics(folder)

    @classmethod
    def frame(cls, rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
        return per_item_frame(rows)


def per_item_frame(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """Rows (as computed, or as read back from CSV) as a typed frame sorted by item."""
    ints = ("item", "answer", "pick", "correct", "clean_pick", "clean_correct", "n_prompt_tokens")
    # runs before the option count was recorded lack n_options
    return typed_frame(rows, "item", ints, floats=("rate",), older=("n_options",))


class Downstream(Experiment[DownstreamResult]):
    """The downstream experiment: one unit per item, one row per (measure, rate)."""

    name = "downstream"

    def __init__(
        self,
        model: LoadedModel,
        items: Sequence[ChoiceItem],
        task: str,
        options: DownstreamOptions,
        *,
        batch_size: int | None = None,
        memory_bytes: int = DEFAULT_MEMORY_BYTES,
        source: str | None = None,
    ) -> None:
        if not items:
            raise ValueError("no items given; load some with cw.data.load_task(task, n)")
        self.model, self.items, self.task, self.options = model, list(items), task, options
        self.batch_size, self.memory_bytes, self.source = batch_size, memory_bytes, source
        self.removals = options.removals()

    def config(self) -> dict[str, Any]:
        o = self.options
        return {
            "experiment": self.name,
            "task": self.task,
            "model": self.model.name,
            "measures": o.measures,
            "rates": o.rates,
            "protect_sinks": o.protect_sinks,
            "sink_cosine": o.sink_cosine,
            "intervention": o.intervention,
            "baselines": o.baselines,
            "random_seeds": o.random_seeds,
            "max_tokens": o.max_tokens,
            "n_items": len(self.items),
            # resuming with other items (prompt, options or answer) is refused
            "items_sha256": fingerprint([it.prompt, it.options, it.answer] for it in self.items),
            **({"source": self.source} if self.source else {}),
        }

    def run(self, i: int) -> list[dict[str, Any]]:
        item, o = self.items[i], self.options
        prompt, options = encode_item(self.model, item)
        length = len(prompt) + max(len(x) for x in options)
        if length > o.max_tokens:
            raise SkipUnit(f"{length} tokens (prompt and longest option) > max_tokens")
        scores = option_scores(
            self.model, prompt, options, [CLEAN, *self.removals],
            protect_sinks=o.protect_sinks, sink_cosine=o.sink_cosine,
            batch_size=self.batch_size, memory_bytes=self.memory_bytes, how=o.intervention,
        )  # fmt: skip
        picks = pick(scores).tolist()
        clean_ok = int(picks[0] == item.answer)
        return [
            {
                "item": i,
                "measure": r.measure,
                "rate": r.rate,
                "answer": item.answer,
                "pick": pk,
                "correct": int(pk == item.answer),
                "clean_pick": picks[0],
                "clean_correct": clean_ok,
                "n_prompt_tokens": len(prompt),
                "n_options": len(options),
            }
            for r, pk in zip(self.removals, picks[1:], strict=True)
        ]

    def phases(self) -> Iterator[Phase]:
        yield Phase(
            f"downstream {self.task}",
            range(len(self.items)),
            self.run,
            rows_file=PER_ITEM,
            key="item",
            rows_per_unit=len(self.removals),
        )

    def result(
        self, rows: Mapping[str, list[dict[str, str]]], run_info: dict[str, Any]
    ) -> DownstreamResult:
        return DownstreamResult.from_rows(rows, self.config(), run_info)


def downstream(
    model: LoadedModel,
    items: Sequence[ChoiceItem],
    task: str = "task",
    measures: Sequence[str] = DEFAULT_MEASURES,
    rates: Sequence[float] = DEFAULT_RATES,
    protect_sinks: bool = True,
    max_tokens: int = 512,
    out: str | Path | None = None,
    resume: bool = False,
    batch_size: int | None = None,
    *,
    sink_cosine: float = SINK_COSINE,
    sink_threshold: float | None = None,
    options: DownstreamOptions | None = None,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    progress: bool = True,
    source: str | None = None,
    baselines: Sequence[str] | str = BASELINES,
    intervention: str = "value_zero",
) -> DownstreamResult:
    """Accuracy under sufficiency removal over the prompt tokens, per measure and rate.

    Items whose prompt plus longest option exceed ``max_tokens`` are skipped (listed with
    the reason in ``result.run_info["skipped"]``). ``options`` (a
    :class:`DownstreamOptions`), when given, replaces ``measures``, ``rates``,
    ``protect_sinks``, ``max_tokens``, ``sink_cosine`` (``sink_threshold``: its
    deprecated older name), ``baselines`` and ``intervention``. Run folder, resume and
    data parallel as :func:`faithfulness`.
    ``source``: where the items came from, recorded in the config for people.
    """
    if options is None:
        sink_cosine = renamed_keyword("downstream", "sink_threshold", sink_threshold, sink_cosine)
        options = DownstreamOptions(
            measures=list(split_names(measures)), rates=as_floats(rates),
            protect_sinks=protect_sinks, max_tokens=max_tokens, sink_cosine=sink_cosine,
            baselines=list(split_names(baselines)), intervention=intervention,
        )  # fmt: skip
    experiment = Downstream(
        model,
        items,
        task,
        options,
        batch_size=batch_size,
        memory_bytes=memory_bytes,
        source=source,
    )
    return run_experiment(experiment, out, resume=resume, progress=progress)
