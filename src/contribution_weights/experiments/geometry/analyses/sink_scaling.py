"""Sink-value scaling (paper Figure 6c): perplexity with v_0 scaled by γ in the sink layers.

Not a statistic of the clean pass but passes of its own, run by the experiment after
the clean pass (:class:`~..run.Geometry`'s second phase), once the sink layers are known:
:func:`detect_sink_layers` picks the layers whose mean α_i0 exceeds the threshold, and
:func:`sink_scaling_nll` runs one batch row per γ through :class:`TokenValueScale`
(at token 0, as :class:`~....interventions.SinkValueScale`), a capture intervention scaling v_0
(Σ_j α_ij v_j with v_0 → γ v_0 is the same as α_i0 → γ α_i0). The table: mean ± standard
error over texts of the perplexity and NLL per γ, and the perplexity of the mean NLL.

Control: in the same passes, the same γ applied to the value of a control token instead
of the sink's, in the same layers: per text a random non-sink position c
(:func:`~...stats.control_token`, seeded by the run's seed and the text's number, the
same for every γ; never the last token, which no scored prediction reads), through
:class:`TokenValueScale`. Its table (the same columns) is reported beside the sink's:
a curve the control shares is not the sink's doing. At γ = 1 both are the clean pass
(that row is run once and shared).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from ....capture import AttentionEdit, LayerCall
from ....interventions import (
    DEFAULT_MEMORY_BYTES,
    intervened_logprobs,
    mean_nll,
)
from ....loading import LoadedModel
from ..analysis import Analysis, markdown_table, records, register_analysis
from ..analysis_types import ResultView, SavedRun, TableContext

SCALING_COLUMNS = ("gamma", "ppl_mean", "ppl_se", "nll_mean", "nll_se", "ppl_of_mean_nll", "n")
#: what the control scales in place of the sink's value
CONTROL_TOKEN = "a random non-sink token per text (seeded, not the last), the same for every γ"


@dataclass
class TokenValueScale:
    """Intervention: attention column ``positions[b]`` times ``gammas[b]`` in ``layers``
    (batch row b), i.e. v_p → γ v_p; with every position 0 it scales the sink's value."""

    layers: frozenset[int]
    positions: Tensor  # (B,) long
    gammas: Tensor  # (B,)

    def edit(self, call: LayerCall) -> AttentionEdit | None:
        if call.layer_idx not in self.layers:
            return None
        scale = torch.ones(call.batch, call.num_heads, call.k_len, device=call.query.device)
        rows = torch.arange(call.batch, device=scale.device)
        gammas = self.gammas.to(scale.device, scale.dtype)
        scale[rows, :, self.positions.to(scale.device)] = gammas[:, None]
        return AttentionEdit(scale=scale)


def sink_scaling_nll(
    model: LoadedModel,
    ids: Tensor,
    gammas: Sequence[float],
    layers: Sequence[int],
    *,
    control: int | None = None,
    batch_size: int | None = None,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
) -> list[float]:
    """Mean NLL of one sequence for each γ (v_0 scaled by γ in ``layers``); with
    ``control``, followed by the mean NLL for each γ with the value of token ``control``
    scaled instead (so 2 × len(gammas) numbers).

    One batch row per distinct (token, γ) (γ = 1 is the clean pass whatever the token:
    one row), run by :func:`~....interventions.intervened_logprobs` (chunked to fit
    ``memory_bytes`` unless ``batch_size`` is given, halved on out-of-memory).
    """
    if ids.numel() < 2:
        raise ValueError("perplexity needs at least 2 tokens; pass a longer text")
    if control is not None and not 0 <= control < ids.numel():
        raise ValueError(f"control token {control} is outside the sequence of {ids.numel()}")
    wanted = [(0, float(g)) for g in gammas]
    if control is not None:
        wanted += [(int(control), float(g)) for g in gammas]
    keys = [(0, 1.0) if g == 1.0 else (p, g) for p, g in wanted]  # γ = 1 changes nothing
    distinct = list(dict.fromkeys(keys))
    positions = torch.tensor([p for p, _ in distinct], dtype=torch.long)
    gamma_rows = torch.tensor([g for _, g in distinct], dtype=torch.float32)
    sink_layers = frozenset(int(x) for x in layers)
    logprobs = intervened_logprobs(
        model,
        ids.reshape(-1)[None].expand(len(distinct), -1),
        lambda rows: nullcontext(TokenValueScale(sink_layers, positions[rows], gamma_rows[rows])),
        batch_size=batch_size,
        memory_bytes=memory_bytes,
    )
    nll = dict(zip(distinct, (float(x) for x in mean_nll(logprobs)), strict=True))
    return [nll[key] for key in keys]


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
    # the same columns with a control token's value scaled instead (None: not run)
    control: pd.DataFrame | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "layers": self.layers,
            "by_gamma": records(self.table),
            "skipped": self.skipped,
        }
        if self.control is not None:
            out["control"] = {"token": CONTROL_TOKEN, "by_gamma": records(self.control)}
        return out


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
            gammas = list(ctx.options.gammas)
            result = scaling_table(ctx.sink_layers or [], gammas, np.array(ctx.scaling_nll))
            if ctx.control_nll and len(ctx.control_nll) == len(ctx.scaling_nll):
                result.control = scaling_table([], gammas, np.array(ctx.control_nll)).table
            return result
        return None

    def to_json(self, table: SinkScalingResult) -> dict[str, Any]:
        return {"sink_scaling": table.to_json()}

    def from_saved(self, saved: SavedRun) -> SinkScalingResult | None:
        data = saved.tables.get("sink_scaling")
        if data is None:
            return None
        rows = pd.DataFrame(data["by_gamma"], columns=[*SCALING_COLUMNS])
        rows = rows.astype({c: float for c in SCALING_COLUMNS if c != "n"})
        control = None
        if data.get("control"):
            control = pd.DataFrame(data["control"]["by_gamma"], columns=[*SCALING_COLUMNS])
            control = control.astype({c: float for c in SCALING_COLUMNS if c != "n"})
        return SinkScalingResult(list(data["layers"]), rows, data.get("skipped"), control)

    def markdown(self, table: SinkScalingResult, result: ResultView) -> list[str]:
        lines = ["## Sink-value scaling (Figure 6c)", f"Sink layers: {table.layers}.", ""]
        if table.skipped:
            return [*lines, f"Not run: {table.skipped}.", ""]
        lines += [markdown_table(table.table, index=False), ""]
        if table.control is None:
            return lines
        return [
            *lines,
            f"Control: the same γ on the value of {CONTROL_TOKEN}, in the same layers.",
            "",
            markdown_table(table.control, index=False),
            "",
        ]


register_analysis(SinkScaling())
