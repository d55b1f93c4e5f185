"""Sink-value scaling (paper Figure 6c): perplexity with v_0 scaled by γ in the sink layers.

Not a statistic of the clean pass but passes of its own, run by the experiment after
the clean pass (:class:`~..run.Geometry`'s second phase), once the sink layers are known:
:func:`detect_sink_layers` picks the layers whose mean α_i0 exceeds the threshold, and
:func:`sink_scaling_nll` runs one batch row per γ through
:class:`~....interventions.SinkValueScale`, a capture intervention scaling v_0
(Σ_j α_ij v_j with v_0 → γ v_0 is the same as α_i0 → γ α_i0). The table: mean ± standard
error over texts of the perplexity and NLL per γ, and the perplexity of the mean NLL.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from ....interventions import (
    DEFAULT_MEMORY_BYTES,
    SinkValueScale,
    intervened_logprobs,
    mean_nll,
)
from ....loading import LoadedModel
from ..analysis import Analysis, SavedRun, TableContext, markdown_table, records, register_analysis

if TYPE_CHECKING:
    from ..result import GeometryResult

SCALING_COLUMNS = ("gamma", "ppl_mean", "ppl_se", "nll_mean", "nll_se", "ppl_of_mean_nll", "n")


def sink_scaling_nll(
    model: LoadedModel,
    ids: Tensor,
    gammas: Sequence[float],
    layers: Sequence[int],
    *,
    batch_size: int | None = None,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
) -> list[float]:
    """Mean NLL of one sequence for each γ (v_0 scaled by γ in ``layers``).

    One batch row per γ, run by :func:`~....interventions.intervened_logprobs` (chunked to
    fit ``memory_bytes`` unless ``batch_size`` is given, halved on out-of-memory).
    """
    if ids.numel() < 2:
        raise ValueError("perplexity needs at least 2 tokens; pass a longer text")
    sink_layers = frozenset(int(x) for x in layers)
    gamma_rows = torch.tensor([float(g) for g in gammas], dtype=torch.float32)
    logprobs = intervened_logprobs(
        model,
        ids.reshape(-1)[None].expand(len(gamma_rows), -1),
        lambda rows: nullcontext(SinkValueScale(sink_layers, gamma_rows[rows])),
        batch_size=batch_size,
        memory_bytes=memory_bytes,
    )
    return [float(x) for x in mean_nll(logprobs)]


def detect_sink_layers(sink_rate: np.ndarray, threshold: float = 0.5) -> list[int]:
    """Layers whose mean α_i0 exceeds ``threshold`` (NaN rates never qualify)."""
    return [int(i) for i, rate in enumerate(sink_rate) if not math.isnan(rate) and rate > threshold]


# ---- the analysis --------------------------------------------------------------------------
@dataclass
class SinkScalingResult:
    """Perplexity against the sink-value scale γ (Figure 6c)."""

    layers: list[int]
    table: pd.DataFrame  # gamma, ppl_mean, ppl_se, nll_mean, nll_se, ppl_of_mean_nll, n
    skipped: str | None = None  # why the passes did not run (no sink layer); table empty

    def to_json(self) -> dict[str, Any]:
        return {"layers": self.layers, "by_gamma": records(self.table), "skipped": self.skipped}


def scaling_table(layers: list[int], gammas: list[float], nll: np.ndarray) -> SinkScalingResult:
    """``nll (n_sequences, n_gammas)`` → mean ± standard error of PPL and NLL per γ.

    Sequences too short to score (NaN rows) are left out.
    """
    nll = nll[~np.isnan(nll).any(1)].reshape(-1, len(gammas))
    n = nll.shape[0]
    if n == 0:
        nll = np.full((1, len(gammas)), np.nan)
    ppl = np.exp(nll)

    def se(x: np.ndarray) -> np.ndarray:
        return x.std(0, ddof=1) / math.sqrt(n) if n > 1 else np.full(x.shape[1], np.nan)

    table = pd.DataFrame(
        {
            "gamma": gammas,
            "ppl_mean": ppl.mean(0),
            "ppl_se": se(ppl),
            "nll_mean": nll.mean(0),
            "nll_se": se(nll),
            "ppl_of_mean_nll": np.exp(nll.mean(0)),
            "n": n,
        }
    )
    return SinkScalingResult(layers, table)


class SinkScaling(Analysis[SinkScalingResult]):
    """Figure 6c: perplexity with v_0 scaled by γ in the sink layers (its own passes)."""

    name = "sink_scaling"

    def build(self, ctx: TableContext) -> SinkScalingResult | None:
        if ctx.scaling_skipped:
            empty = pd.DataFrame(columns=[*SCALING_COLUMNS])
            return SinkScalingResult([], empty, ctx.scaling_skipped)
        if ctx.scaling_nll:  # NaN rows: too short
            return scaling_table(
                ctx.sink_layers or [], list(ctx.options.gammas), np.array(ctx.scaling_nll)
            )
        return None

    def to_json(self, table: SinkScalingResult) -> dict[str, Any]:
        return {"sink_scaling": table.to_json()}

    def from_saved(self, saved: SavedRun) -> SinkScalingResult | None:
        data = saved.tables.get("sink_scaling")
        if data is None:
            return None
        rows = pd.DataFrame(data["by_gamma"], columns=[*SCALING_COLUMNS])
        rows = rows.astype({c: float for c in SCALING_COLUMNS if c != "n"})
        return SinkScalingResult(list(data["layers"]), rows, data.get("skipped"))

    def markdown(self, table: SinkScalingResult, result: GeometryResult) -> list[str]:
        lines = ["## Sink-value scaling (Figure 6c)", f"Sink layers: {table.layers}.", ""]
        if table.skipped:
            return [*lines, f"Not run: {table.skipped}.", ""]
        return [*lines, markdown_table(table.table, index=False), ""]


register_analysis(SinkScaling())
