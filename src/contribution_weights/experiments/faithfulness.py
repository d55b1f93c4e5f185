"""Faithfulness on language modelling (method §4, paper §5 and Figure 3).

For each sequence, every (measure, mode, rate) configuration plus one clean row run as
one batched forward (:func:`~..interventions.token_logprobs`); the score is the perplexity of
the sequence, and each configuration is reported as ΔPPL = PPL_removed − PPL_clean and
ΔNLL against the clean row of the same pass. Per-sequence rows are appended to
``per_sequence.csv`` as each sequence finishes, so an interrupted run resumes where it
stopped. The run loop is :mod:`.runner`'s (resume, run_info, data parallel).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
from torch import Tensor

from ..attribution.flow import end_to_end_scores
from ..defaults import BASELINES
from ..inputs import encode
from ..interventions import (
    CLEAN,
    DEFAULT_MEMORY_BYTES,
    MODES,
    SINK_COSINE,
    global_thresholds,
    mean_nll,
    token_logprobs,
)
from ..loading import LoadedModel
from ..runs import fingerprint, renamed_keyword
from .options import (  # the options are light: the CLI reads them before torch
    DEFAULT_MEASURES,
    DEFAULT_RATES,
    FaithfulnessOptions,
    as_floats,
    split_names,
)
from .paired import METRIC, REFERENCE, paired_differences, ranking_table
from .result import SUMMARY as SUMMARY  # re-exported: the summary file
from .result import RowsResult, rows_named, typed_frame, warn_few_samples, write_csv
from .runner import Experiment, Phase, SkipUnit, run_experiment

PER_SEQUENCE = "per_sequence.csv"
PAIRED = "summary_paired.csv"  # the reference against every other ranking (.paired)
RANKINGS = "summary_rankings.csv"  # every ranking, its wins over the others (.rankings)
SUMMARY_COLUMNS = [
    "measure",
    "mode",
    "rate",
    "n",
    "delta_ppl_mean",
    "delta_ppl_se",
    "delta_nll_mean",
    "delta_nll_se",
]


def sequence_rows(
    model: LoadedModel,
    ids: Tensor,
    options: FaithfulnessOptions,
    *,
    batch_size: int | None = None,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
) -> list[dict[str, Any]]:
    """One row per configuration of one sequence ``ids`` ``(T,)``: ppl, nll and their deltas."""
    removals = options.removals()
    # the end-to-end rankings' scores (flow, rollout, alti), once per text for both passes
    fixed = end_to_end_scores(model, ids, [r.measure for r in removals])
    if options.scope == "global":
        removals = global_thresholds(
            model.model,
            ids.to(model.device),
            removals,
            protect_sinks=options.protect_sinks,
            sink_cosine=options.sink_cosine,
            fixed_scores=fixed,
        )
    rows = [CLEAN, *removals]
    logp = token_logprobs(
        model,
        ids[None].expand(len(rows), -1),
        rows,
        protect_sinks=options.protect_sinks,
        scope=options.scope,
        sink_cosine=options.sink_cosine,
        batch_size=batch_size,
        memory_bytes=memory_bytes,
        how=options.intervention,
        fixed_scores=fixed,
    )
    nll = mean_nll(logp)
    nll_clean = float(nll[0])
    out = []
    for r, value in zip(removals, nll[1:].tolist(), strict=True):
        out.append(
            {
                "measure": r.measure,
                "mode": r.mode,
                "rate": r.rate,
                "n_tokens": int(ids.numel()),
                "nll": value,
                "ppl": math.exp(value),
                "nll_clean": nll_clean,
                "ppl_clean": math.exp(nll_clean),
                "delta_nll": value - nll_clean,
                "delta_ppl": math.exp(value) - math.exp(nll_clean),
                "threshold": r.threshold if r.threshold is not None else "",
            }
        )
    return out


def summarise(per_sequence: pd.DataFrame) -> pd.DataFrame:
    """Mean and standard error over sequences of ΔPPL and ΔNLL per (measure, mode, rate)."""
    if per_sequence.empty:
        return pd.DataFrame(columns=SUMMARY_COLUMNS)
    g = per_sequence.groupby(["measure", "mode", "rate"], sort=False)
    out = g.agg(
        n=("delta_ppl", "size"),
        delta_ppl_mean=("delta_ppl", "mean"),
        delta_ppl_se=("delta_ppl", "sem"),
        delta_nll_mean=("delta_nll", "mean"),
        delta_nll_se=("delta_nll", "sem"),
    ).reset_index()
    return out[SUMMARY_COLUMNS]


class FaithfulnessResult(RowsResult):
    """Per-sequence rows, their summary, the run's configuration and run_info."""

    ROWS = PER_SEQUENCE

    per_sequence = rows_named(
        "One row per (sequence, measure, mode, rate): its NLL and PPL, clean and removed."
    )

    def summarise_rows(self) -> pd.DataFrame:
        return summarise(self.rows)

    def paired(self, reference: str = REFERENCE, metric: str = METRIC) -> pd.DataFrame:
        """Paired differences reference − other per (mode, rate, other ranking): n, mean,
        s.e., bootstrap 95% interval, p, Holm-corrected p and verdict (:mod:`.paired`)."""
        return paired_differences(self.rows, reference, metric)

    def rankings(self, metric: str = METRIC) -> pd.DataFrame:
        """Per (mode, rate, ranking): n, mean, s.e. and wins/losses/ties against every
        other ranking by the paired verdicts (:func:`.paired.ranking_table`)."""
        return ranking_table(self.rows, metric)

    def write_statistics(self, folder: str | Path) -> None:
        """Write ``summary_rankings.csv`` and, when the reference (IHC) was run,
        ``summary_paired.csv`` into ``folder`` (nothing else is touched)."""
        folder = Path(folder)
        write_csv(folder / RANKINGS, self.rankings())
        if not self.rows.empty and REFERENCE in set(self.rows["measure"]):
            write_csv(folder / PAIRED, self.paired())

    def write_summary(self, folder: Path) -> None:
        super().write_summary(folder)
        self.write_statistics(folder)

    @classmethod
    def frame(cls, rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
        return per_sequence_frame(rows)


def per_sequence_frame(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """Rows (as computed, or as read back from CSV) as a typed frame sorted by sequence."""
    return typed_frame(
        rows,
        "seq",
        ints=("seq", "n_tokens"),
        floats=("rate", "nll", "ppl", "nll_clean", "ppl_clean", "delta_nll", "delta_ppl"),
        blanks=("threshold",),  # NaN: layer scope
    )


class Faithfulness(Experiment[FaithfulnessResult]):
    """The faithfulness experiment: one unit per text, one row per configuration."""

    name = "faithfulness"

    def __init__(
        self,
        model: LoadedModel,
        texts: Sequence[str],
        options: FaithfulnessOptions,
        *,
        source: str | None = None,
        batch_size: int | None = None,
        memory_bytes: int = DEFAULT_MEMORY_BYTES,
    ) -> None:
        if isinstance(texts, str):
            texts = [texts]
        if not texts:
            raise ValueError("no texts given; pass a list of texts (or --dataset/--texts/--file)")
        self.model, self.texts, self.options = model, list(texts), options
        self.source, self.batch_size, self.memory_bytes = source, batch_size, memory_bytes

    def config(self) -> dict[str, Any]:
        return {
            "experiment": self.name,
            "model": self.model.name,
            **self.options.to_dict(),
            "n_texts": len(self.texts),
            "texts_sha256": fingerprint(self.texts),
            "source": self.source,
        }

    def older_keys(self) -> dict[str, tuple[str, Any]]:
        """Run folders written before every experiment used ``texts_sha256`` hold the sha1
        fingerprint as ``texts_sha1``; they resume when it matches these texts."""
        return {"texts_sha1": ("texts_sha256", fingerprint(self.texts, algorithm="sha1"))}

    def run(self, i: int) -> list[dict[str, Any]]:
        text = self.texts[i]
        if not text.strip():
            raise SkipUnit("blank text")
        ids = encode(self.model, text, self.options.max_tokens, truncate=True)
        if ids.numel() < 2:
            raise SkipUnit("fewer than 2 tokens: no next token to score")
        rows = sequence_rows(
            self.model, ids, self.options,
            batch_size=self.batch_size, memory_bytes=self.memory_bytes,
        )  # fmt: skip
        return [{"seq": i, **r} for r in rows]

    def phases(self) -> Iterator[Phase]:
        yield Phase(
            "faithfulness",
            range(len(self.texts)),
            self.run,
            rows_file=PER_SEQUENCE,
            key="seq",
            rows_per_unit=len(self.options.removals()),
        )

    def result(
        self, rows: Mapping[str, list[dict[str, str]]], run_info: dict[str, Any]
    ) -> FaithfulnessResult:
        return FaithfulnessResult.from_rows(rows, self.config(), run_info)


def faithfulness(
    model: LoadedModel,
    texts: Sequence[str],
    measures: Sequence[str] = DEFAULT_MEASURES,
    rates: Sequence[float] = DEFAULT_RATES,
    modes: Sequence[str] = MODES,
    protect_sinks: bool = True,
    scope: str = "layer",
    max_tokens: int = 512,
    out: str | Path | None = None,
    resume: bool = False,
    batch_size: int | None = None,
    *,
    sink_cosine: float = SINK_COSINE,
    sink_threshold: float | None = None,
    options: FaithfulnessOptions | None = None,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    progress: bool = True,
    source: str | None = None,
    baselines: Sequence[str] | str = BASELINES,
    intervention: str = "value_zero",
) -> FaithfulnessResult:
    """Comprehensiveness and sufficiency of each measure on ``texts`` (method §4).

    Texts longer than ``max_tokens`` are truncated to their first ``max_tokens`` tokens;
    blank texts and texts of fewer than 2 tokens are skipped (listed with the reason in
    ``result.run_info["skipped"]``).
    With ``out`` the run is written to that folder (``config.json``, ``per_sequence.csv``
    appended per sequence, then ``summary.csv`` and ``run_info.json``; the figure is the
    caller's: ``cw.plot(result, path)``, as ``cw faithfulness`` does); ``resume``
    continues a run there, skipping finished sequences. Launched with several processes
    (``accelerate launch -m contribution_weights faithfulness ...``) the sequences are
    split over them (see :mod:`.runner`).

    ``options`` (a :class:`FaithfulnessOptions`, as ``cw faithfulness`` builds it), when
    given, is used instead of ``measures``, ``rates``, ``modes``, ``protect_sinks``,
    ``scope``, ``max_tokens``, ``sink_cosine`` (``sink_threshold`` is its deprecated
    older name), ``baselines`` (rankings beside the measures: ``random`` and ``recency``
    by default, ``"none"`` for none) and ``intervention``.
    """
    if options is None:
        sink_cosine = renamed_keyword("faithfulness", "sink_threshold", sink_threshold, sink_cosine)
        options = FaithfulnessOptions(
            measures=list(split_names(measures)), rates=as_floats(rates),
            modes=list(split_names(modes)), protect_sinks=protect_sinks, scope=scope,
            max_tokens=max_tokens, sink_cosine=sink_cosine, baselines=list(split_names(baselines)),
            intervention=intervention,
        )  # fmt: skip
    experiment = Faithfulness(
        model, texts, options, source=source, batch_size=batch_size, memory_bytes=memory_bytes
    )
    warn_few_samples(len(texts), "text", "delta_ppl_se, delta_nll_se")
    return run_experiment(experiment, out, resume=resume, progress=progress)
