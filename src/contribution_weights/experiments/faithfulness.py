"""Faithfulness on language modelling (method §4, paper §5 and Figure 3).

For each sequence, every (measure, mode, rate) configuration plus one clean row run as
one batched forward (:func:`~..interventions.token_logprobs`); the score is the perplexity of
the sequence, and each configuration is reported as ΔPPL = PPL_removed − PPL_clean and
ΔNLL against the clean row of the same pass. Per-sequence rows are appended to
``per_sequence.csv`` as each sequence finishes, so an interrupted run resumes where it
stopped. The run loop is :mod:`.runner`'s (resume, run_info, data parallel).
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from torch import Tensor

from ..inputs import encode
from ..interventions import (
    CLEAN,
    DEFAULT_MEMORY_BYTES,
    MODES,
    SCOPES,
    SINK_COSINE,
    Removal,
    global_thresholds,
    mean_nll,
    token_logprobs,
)
from ..loading import LoadedModel
from ..measures.registry import resolve_measures
from ..runs import fingerprint
from .options import Options, as_floats, option, split_names
from .result import ExperimentResult, read_csv, write_csv
from .runner import Experiment, Phase, SkipUnit, run_experiment

DEFAULT_MEASURES = ("attention", "vw", "vw_on", "ihc")
DEFAULT_RATES = (0.1, 0.2, 0.3, 0.4, 0.5)
PER_SEQUENCE = "per_sequence.csv"
SUMMARY = "summary.csv"
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


@dataclass
class FaithfulnessOptions(Options):
    """Options of :func:`faithfulness` and ``cw faithfulness`` (checked on creation)."""

    measures: list[str] = option(
        DEFAULT_MEASURES, "comma-separated measures (any registered measure)",
        flag="--measures", parse="names",
    )  # fmt: skip
    rates: list[float] = option(
        DEFAULT_RATES, "removal rates p, each in [0, 1]", flag="--rates", parse="floats"
    )
    modes: list[str] = option(
        MODES, "comprehensiveness and/or sufficiency", flag="--modes", parse="names"
    )
    protect_sinks: bool = option(
        True, "let sink tokens be removed too (appendix C.3)",
        flag="--no-sink-protection", parse="no-flag",
    )  # fmt: skip
    scope: str = option("layer", "ranking scope", flag="--scope", choices=SCOPES)
    max_tokens: int = option(
        512, "keep the first N tokens of longer texts (texts under 2 tokens are skipped)",
        flag="--max-tokens", parse="int",
    )  # fmt: skip
    sink_cosine: float = option(
        SINK_COSINE,
        "a token is a sink at a layer when its layer-input hidden state has cosine above "
        "this with token 0's",
        flag="--sink-cosine", parse="float", aliases=("--sink-threshold",),
    )  # fmt: skip

    def validate(self) -> None:
        self.measures = resolve_measures(self.measures)  # a string is a name or "a,b"
        self.modes = list(dict.fromkeys(split_names(self.modes)))
        for m in self.modes:
            if m not in MODES:
                raise ValueError(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
        if not self.modes:
            raise ValueError(f"no mode given; choose from {', '.join(MODES)}")
        if self.scope not in SCOPES:
            raise ValueError(f"unknown scope {self.scope!r}; choose from {', '.join(SCOPES)}")
        self.rates = check_rates(self.rates)
        self.max_tokens = check_max_tokens(self.max_tokens)
        self.sink_cosine = check_sink_cosine(self.sink_cosine)
        self.protect_sinks = bool(self.protect_sinks)

    def check(self) -> FaithfulnessOptions:
        """Validated already on creation; kept for callers of the older API."""
        self.validate()
        return self

    def removals(self) -> list[Removal]:
        return [
            Removal(m, mode, rate)
            for m, mode, rate in itertools.product(self.measures, self.modes, self.rates)
        ]


def check_rates(rates: Any) -> list[float]:
    """Sorted distinct removal rates, each in [0, 1]."""
    out = sorted(set(as_floats(rates)))
    if not out or any(not 0 <= r <= 1 for r in out):
        raise ValueError(f"rates must be in [0, 1], got {rates}; pass e.g. 0.1,0.5")
    return out


def check_max_tokens(max_tokens: Any) -> int:
    if int(max_tokens) < 2:
        raise ValueError(f"max_tokens must be at least 2 (a token and its next), got {max_tokens}")
    return int(max_tokens)


def check_sink_cosine(value: Any) -> float:
    if not -1 <= float(value) <= 1:
        raise ValueError(
            f"sink_cosine is a cosine, in [-1, 1]; got {value} (default {SINK_COSINE})"
        )
    return float(value)


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
    if options.scope == "global":
        removals = global_thresholds(
            model.model,
            ids.to(model.device),
            removals,
            protect_sinks=options.protect_sinks,
            sink_cosine=options.sink_cosine,
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


class FaithfulnessResult(ExperimentResult):
    """Per-sequence rows, their summary, the run's configuration and run_info."""

    def __init__(
        self,
        per_sequence: pd.DataFrame,
        config: dict[str, Any],
        run_info: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(config, run_info)
        self.per_sequence = per_sequence
        self.summary = summarise(per_sequence)

    def plot(self, path: str | Path | None = None) -> Any:
        """ΔPPL against rate, one line per measure, a panel per mode (matplotlib Figure)."""
        from ..presentation.faithfulness_plots import plot_faithfulness

        c = self.config
        n = int(self.summary["n"].max()) if not self.summary.empty else 0
        source = c.get("source") or "texts"
        title = f"{c.get('model')} · {source} · n={n} · ≤{c.get('max_tokens')} tokens"
        return plot_faithfulness(self.summary, path=path, title=title)

    def write_summary(self, folder: Path) -> None:
        write_csv(folder / SUMMARY, self.summary)

    def write_files(self, folder: Path) -> None:
        write_csv(folder / PER_SEQUENCE, self.per_sequence)
        self.write_summary(folder)

    @classmethod
    def from_files(
        cls, folder: Path, config: dict[str, Any], run_info: dict[str, Any]
    ) -> FaithfulnessResult:
        return cls(per_sequence_frame(read_csv(folder / PER_SEQUENCE)), config, run_info)


def per_sequence_frame(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """Rows (as computed, or as read back from CSV) as a typed frame sorted by sequence."""
    frame = pd.DataFrame(list(rows))
    if frame.empty:
        return frame
    for col in ("seq", "n_tokens"):
        frame[col] = frame[col].astype(int)
    for col in ("rate", "nll", "ppl", "nll_clean", "ppl_clean", "delta_nll", "delta_ppl"):
        frame[col] = frame[col].astype(float)
    frame["threshold"] = pd.to_numeric(frame["threshold"], errors="coerce")  # NaN: layer scope
    return frame.sort_values(["seq"], kind="stable").reset_index(drop=True)


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
            "texts_sha1": fingerprint(self.texts, algorithm="sha1"),  # sha1: older runs resume
            "source": self.source,
        }

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
        frame = per_sequence_frame(rows[PER_SEQUENCE])
        return FaithfulnessResult(frame, self.config(), run_info)


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
) -> FaithfulnessResult:
    """Comprehensiveness and sufficiency of each measure on ``texts`` (method §4).

    Texts longer than ``max_tokens`` are truncated to their first ``max_tokens`` tokens;
    blank texts and texts of fewer than 2 tokens are skipped (listed with the reason in
    ``result.run_info["skipped"]``).
    With ``out`` the run is written to that folder (``config.json``, ``per_sequence.csv``
    appended per sequence, then ``summary.csv`` and ``run_info.json``; figures are the
    caller's: ``result.plot(path)``, as ``cw faithfulness`` does); ``resume``
    continues a run there, skipping finished sequences. Launched with several processes
    (``accelerate launch -m contribution_weights faithfulness ...``) the sequences are
    split over them (see :mod:`.runner`).

    ``options`` (a :class:`FaithfulnessOptions`, as ``cw faithfulness`` builds it), when
    given, is used instead of ``measures``, ``rates``, ``modes``, ``protect_sinks``,
    ``scope``, ``max_tokens`` and ``sink_cosine`` (``sink_threshold`` is its deprecated
    older name).
    """
    if options is None:
        if sink_threshold is not None:
            warnings.warn(
                "faithfulness(sink_threshold=) is deprecated; use sink_cosine=",
                DeprecationWarning,
                stacklevel=2,
            )
            sink_cosine = sink_threshold
        options = FaithfulnessOptions(
            list(split_names(measures)), as_floats(rates), list(split_names(modes)),
            protect_sinks, scope, max_tokens, sink_cosine,
        )  # fmt: skip
    experiment = Faithfulness(
        model, texts, options, source=source, batch_size=batch_size, memory_bytes=memory_bytes
    )
    return run_experiment(experiment, out, resume=resume, progress=progress)
