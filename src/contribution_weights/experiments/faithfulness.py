"""Faithfulness on language modelling (method §4, paper §5 and Figure 3).

For each sequence, every (measure, mode, rate) configuration plus one clean row run as
one batched forward (:func:`~.removal.token_logprobs`); the score is the perplexity of
the sequence, and each configuration is reported as ΔPPL = PPL_removed − PPL_clean and
ΔNLL against the clean row of the same pass. Per-sequence rows are appended to
``per_sequence.csv`` as each sequence finishes, so an interrupted run resumes where it
stopped.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from torch import Tensor
from tqdm.auto import tqdm

from ..inputs import encode
from ..interventions import CLEAN, MODES, SCOPES, SINK_COSINE, Removal, global_thresholds
from ..loading import LoadedModel
from ..measures.registry import resolve_measures
from ..runs import RunFolder, fingerprint
from .removal import DEFAULT_MEMORY_BYTES, mean_nll, token_logprobs

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
class FaithfulnessOptions:
    """Options shared by :func:`faithfulness` and ``cw faithfulness``."""

    measures: Sequence[str] = DEFAULT_MEASURES
    rates: Sequence[float] = DEFAULT_RATES
    modes: Sequence[str] = MODES
    protect_sinks: bool = True
    scope: str = "layer"
    max_tokens: int = 512
    sink_threshold: float = SINK_COSINE

    def check(self) -> FaithfulnessOptions:
        measures = resolve_measures(self.measures)  # a string is a name or "a,b", not letters
        modes = list(dict.fromkeys(split_names(self.modes)))
        for m in modes:
            if m not in MODES:
                raise ValueError(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
        if self.scope not in SCOPES:
            raise ValueError(f"unknown scope {self.scope!r}; choose from {', '.join(SCOPES)}")
        rates = sorted({float(r) for r in as_floats(self.rates)})
        if not rates or any(not 0 <= r <= 1 for r in rates):
            raise ValueError(f"rates must be in [0, 1], got {list(self.rates)}")
        if self.max_tokens < 2:
            raise ValueError("max_tokens must be at least 2")
        if not -1 <= self.sink_threshold <= 1:
            raise ValueError(
                f"sink_threshold is a cosine, in [-1, 1]; got {self.sink_threshold} "
                f"(default {SINK_COSINE})"
            )
        return FaithfulnessOptions(
            measures, rates, modes, self.protect_sinks, self.scope, self.max_tokens,
            self.sink_threshold,
        )  # fmt: skip

    def removals(self) -> list[Removal]:
        return [
            Removal(m, mode, rate)
            for m, mode, rate in itertools.product(self.measures, self.modes, self.rates)
        ]


def split_names(value: str | Sequence[str]) -> list[str]:
    """``"a,b"`` or ``["a", "b"]`` -> ``["a", "b"]`` (a string is never split into letters)."""
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return list(value)


def as_floats(value: float | Sequence[float]) -> list[float]:
    """One rate or a sequence of rates as a list."""
    return [float(value)] if isinstance(value, (int, float)) else [float(v) for v in value]


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
            sink_threshold=options.sink_threshold,
        )
    rows = [CLEAN, *removals]
    logp = token_logprobs(
        model,
        ids[None].expand(len(rows), -1),
        rows,
        protect_sinks=options.protect_sinks,
        scope=options.scope,
        sink_threshold=options.sink_threshold,
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


@dataclass
class FaithfulnessResult:
    """Per-sequence rows, their summary, and the run's configuration."""

    per_sequence: pd.DataFrame
    config: dict[str, Any]
    summary: pd.DataFrame = field(init=False)

    def __post_init__(self) -> None:
        self.summary = summarise(self.per_sequence)

    def plot(self, path: str | Path | None = None) -> Any:
        """ΔPPL against rate, one line per measure, a panel per mode (matplotlib Figure)."""
        from ..presentation.faithfulness_plots import plot_faithfulness

        c = self.config
        n = int(self.summary["n"].max()) if not self.summary.empty else 0
        source = c.get("source") or "texts"
        title = f"{c.get('model')} · {source} · n={n} · ≤{c.get('max_tokens')} tokens"
        return plot_faithfulness(self.summary, path=path, title=title)

    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.per_sequence.to_csv(folder / PER_SEQUENCE, index=False)
        self.summary.to_csv(folder / SUMMARY, index=False)
        return folder

    @classmethod
    def load(cls, folder: str | Path) -> FaithfulnessResult:
        import json

        folder = Path(folder)
        config = json.loads((folder / "config.json").read_text())
        return cls(pd.read_csv(folder / PER_SEQUENCE), config)


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
    sink_threshold: float = SINK_COSINE,
    options: FaithfulnessOptions | None = None,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    progress: bool = True,
    source: str | None = None,
) -> FaithfulnessResult:
    """Comprehensiveness and sufficiency of each measure on ``texts`` (method §4).

    Texts longer than ``max_tokens`` are truncated to their first ``max_tokens`` tokens;
    blank texts and texts of fewer than 2 tokens are skipped (counted in
    ``config["skipped"]``).
    With ``out`` the run is written to that folder (``config.json``, ``per_sequence.csv``
    appended per sequence, then ``summary.csv``; figures are the caller's:
    ``result.plot(path)``, as ``cw faithfulness`` does); ``resume``
    continues a run there, skipping finished sequences.

    ``options`` (a :class:`FaithfulnessOptions`, as ``cw faithfulness`` builds it), when
    given, is used instead of ``measures``, ``rates``, ``modes``, ``protect_sinks``,
    ``scope``, ``max_tokens`` and ``sink_threshold``.
    """
    if isinstance(texts, str):
        texts = [texts]
    if not texts:
        raise ValueError("no texts given; pass a list of texts (or --dataset/--texts/--file)")
    if options is None:
        options = FaithfulnessOptions(
            measures, rates, modes, protect_sinks, scope, max_tokens, sink_threshold
        )
    opts = options.check()
    config = {
        "experiment": "faithfulness",
        "model": model.name,
        **{k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in asdict(opts).items()},
        "n_texts": len(texts),
        "texts_sha1": fingerprint(texts, algorithm="sha1"),  # sha1: older runs resume
        "source": source,
    }
    folder = RunFolder(out, config, resume=resume) if out is not None else None
    rows: list[dict[str, Any]] = []
    done: set[int] = set()
    if folder is not None:  # a sequence is done only when all its rows were written
        kept, keys = folder.complete_rows(PER_SEQUENCE, "seq", len(opts.removals()))
        rows, done = list(kept), {int(k) for k in keys}
    todo = [i for i in range(len(texts)) if i not in done]
    bar = tqdm(total=len(texts), initial=len(done), desc="faithfulness", unit="seq",
               disable=not progress)  # fmt: skip
    started = time.perf_counter()
    skipped = 0
    try:
        for i in todo:
            ids = (
                encode(model, texts[i], opts.max_tokens, truncate=True)
                if texts[i].strip()
                else None
            )
            if ids is None or ids.numel() < 2:  # blank, or no next token to score
                skipped += 1
                bar.update(1)
                continue
            seq_rows = [
                {"seq": i, **r}
                for r in sequence_rows(
                    model, ids, opts, batch_size=batch_size, memory_bytes=memory_bytes
                )
            ]
            if folder is not None:
                folder.append_rows(PER_SEQUENCE, seq_rows)
            rows.extend(seq_rows)
            bar.update(1)
    finally:
        bar.close()
    frame = pd.DataFrame(rows)
    if not frame.empty:
        for col in ("seq", "n_tokens"):
            frame[col] = frame[col].astype(int)
        for col in ("rate", "nll", "ppl", "nll_clean", "ppl_clean", "delta_nll", "delta_ppl"):
            frame[col] = frame[col].astype(float)
        frame = frame.sort_values(["seq"], kind="stable").reset_index(drop=True)
    config["skipped"] = skipped
    config["seconds"] = round(time.perf_counter() - started, 1)
    result = FaithfulnessResult(frame, config)
    if folder is not None:
        result.summary.to_csv(folder.file(SUMMARY), index=False)
    return result
