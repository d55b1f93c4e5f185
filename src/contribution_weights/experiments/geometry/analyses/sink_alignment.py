"""Sink / tail alignment (paper Figure 5): how the sink's value lines up with the others.

Per layer and head, the mean of cos(ṽ_0, ṽ_j) over j ≥ 1 and of cos(ṽ_i, ṽ_j) over
i ≠ j ≥ 1 (computed as (‖Σ u_j‖² − Σ‖u_j‖²)/(n(n−1)) with unit vectors u; a zero vector
counts as cosine 0), averaged over heads and texts.

Null (a permutation null over which token plays the sink): the same statistic with the
sink replaced by a random non-sink token c of each text, the mean over j ≠ c of
cos(ṽ_c, ṽ_j) (j = 0 included: token 0 and c trade places), averaged over heads and texts
the same way; :data:`~...stats.PERMUTATION_DRAWS` draws, each one token per text (the same
in every layer and head), seeded by the run's seed and the text's number. If token 0 were
an ordinary token its statistic would be one of these draws. Reported per layer and for
the mean over layers: the null's mean ± sd and the one-sided p-value of the sink being
*less* aligned with the other tokens than a random token is (the paper's claim),
(1 + #{draws ≤ statistic}) / (1 + draws). With c = 0 a draw is the statistic itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from ....measures.layer import safe_div
from ...options import GeometryOptions
from ...stats import (
    ALIGNMENT_STREAM,
    PERMUTATION_DRAWS,
    BlockView,
    LayerMeans,
    Stat,
    permutation_summary,
    random_tokens,
)
from ..analysis import (
    LayerMeansAnalysis,
    markdown_table,
    null_from_json,
    null_markdown,
    null_to_json,
    num,
    records,
    register_analysis,
)
from ..analysis_types import ResultView, SavedRun, TableContext

COLUMNS = ("sink_tail", "tail_tail")
#: what the null puts in place of the sink, and the direction of its p-value
NULL_TOKEN = "a random non-sink token per text (seeded) in place of token 0"
ALTERNATIVE = "less"
NULL_COLUMNS = ("sink_tail", "null_mean", "null_sd", "p_value")


def alignment(projected: Tensor) -> tuple[Tensor, Tensor]:
    """Per head ``(H,)``: mean cos(ṽ_0, ṽ_j) over j ≥ 1, and mean cos(ṽ_i, ṽ_j), i ≠ j ≥ 1.

    Zero vectors count as cosine 0. Needs at least 2 (sink/tail) and 3 (tail/tail) tokens;
    otherwise the entry is NaN.
    """
    return _alignment(unit_vectors(projected))


def unit_vectors(projected: Tensor) -> Tensor:
    """``projected`` over its norm along the last axis (a zero vector stays zero)."""
    return safe_div(projected, projected.norm(dim=-1, keepdim=True))


def _alignment(unit: Tensor) -> tuple[Tensor, Tensor]:
    h, t, _ = unit.shape
    nan = torch.full((h,), float("nan"), dtype=unit.dtype)
    if t < 2:
        return nan, nan
    tail = unit[:, 1:]
    sink_tail = (tail @ unit[:, 0, :, None]).squeeze(-1).mean(-1)
    n = t - 1
    if n < 2:
        return sink_tail, nan
    total = tail.sum(1)
    pair_sum = total.square().sum(-1) - tail.square().sum((-1, -2))
    return sink_tail, pair_sum / (n * (n - 1))


def token_alignment(projected: Tensor, positions: Tensor) -> Tensor:
    """``(H, K)``: for each position c, the mean over j ≠ c of cos(ṽ_c, ṽ_j) (zero vectors
    count as cosine 0); position 0 gives :func:`alignment`'s ``sink_tail``. Needs T ≥ 2.

    Computed as ⟨u_c, Σ_j u_j⟩ − ‖u_c‖² over T − 1 (unit vectors u) for every c at once.
    """
    return _token_alignment(unit_vectors(projected), positions)


def _token_alignment(unit: Tensor, positions: Tensor) -> Tensor:
    t = unit.shape[1]
    every = (unit @ unit.sum(1)[:, :, None]).squeeze(-1) - unit.square().sum(-1)  # (H, T)
    return every[:, positions] / (t - 1)


class SinkAlignment(LayerMeans):
    """Figure 5: per layer, mean over heads of the sink/tail and tail/tail cosines; and
    the permutation null of the sink/tail cosine (``null_total``: per layer and draw, the
    sum over sequences of the drawn token's mean cosine)."""

    columns = COLUMNS

    def __init__(self, num_layers: int, seed: int = 0, draws: int = PERMUTATION_DRAWS) -> None:
        super().__init__(num_layers)
        self.null_total = np.zeros((num_layers, draws))
        self.null_count = np.zeros(num_layers)
        self.null_sequences = 0  # sequences the null saw (all of them, or it is not shown)
        self._seed = seed
        self._positions = torch.zeros(0, dtype=torch.long)
        self._null_seq = np.zeros((num_layers, draws))
        self._null_seen = np.zeros(num_layers, dtype=bool)

    def begin(self, num_tokens: int, unit: int = 0) -> None:
        super().begin(num_tokens, unit)
        draws = self.null_total.shape[1]
        positions = random_tokens(num_tokens, draws, self._seed, unit, ALIGNMENT_STREAM)
        self._positions = torch.from_numpy(positions)
        self._null_seq[:] = 0
        self._null_seen[:] = False

    def observe(self, view: BlockView) -> None:
        if not view.first_block:
            return
        unit = unit_vectors(view.projected_values)
        sink_tail, tail_tail = _alignment(unit)
        for k, value in enumerate((sink_tail, tail_tail)):
            if not bool(torch.isnan(value).any()):
                self._seq[view.layer, k] += float(value.mean())
                self._seq_n[view.layer, k] += 1
        if len(self._positions) and not bool(torch.isnan(sink_tail).any()):
            null = _token_alignment(unit, self._positions.to(unit.device))
            self._null_seq[view.layer] = null.double().mean(0).cpu().numpy()
            self._null_seen[view.layer] = True

    def end(self) -> None:
        super().end()
        self.null_total[self._null_seen] += self._null_seq[self._null_seen]
        self.null_count[self._null_seen] += 1
        self.null_sequences += 1

    def merge(self, state: dict[str, Any]) -> None:
        super().merge(state)
        if "null_total" in state:  # else the null misses those sequences (and is not shown)
            self.null_total = self.null_total + state["null_total"]
            self.null_count = self.null_count + state["null_count"]
            self.null_sequences += int(state["null_sequences"])

    def null_draws(self) -> np.ndarray | None:
        """``(L, draws)``: per layer and draw, the mean over sequences of the drawn token's
        mean cosine (NaN where no sequence counted); None unless the null saw every
        sequence."""
        if self.null_sequences != self.sequences:
            return None
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.null_total / np.where(self.null_count > 0, self.null_count, np.nan)[:, None]


def null_table(by_layer: pd.DataFrame, draws: np.ndarray) -> pd.DataFrame:
    """Per layer and for the mean over layers (row ``mean``): the sink/tail cosine, the
    null's mean ± sd over draws and the one-sided p-value (:data:`ALTERNATIVE`)."""
    stat = by_layer["sink_tail"].to_numpy(dtype=float)
    rows = [
        {"sink_tail": s, **permutation_summary(s, d, ALTERNATIVE)}
        for s, d in zip(stat, draws, strict=True)
    ]
    counted = ~np.isnan(stat)  # the mean over layers leaves out layers with no sequence
    overall = float(stat[counted].mean()) if counted.any() else float("nan")
    overall_draws = draws[counted].mean(0) if counted.any() else np.zeros(0)
    rows.append({"sink_tail": overall, **permutation_summary(overall, overall_draws, ALTERNATIVE)})
    index = pd.Index([*by_layer.index, "mean"], dtype=object, name="layer")
    return pd.DataFrame(rows, index, list(NULL_COLUMNS))


# ---- the analysis: the per-layer DataFrame (sink_tail, tail_tail) and the null ----------------
@dataclass
class SinkAlignmentTables:
    """Per layer the mean cosines (``result.sink_alignment``), and the permutation null of
    the sink/tail cosine (``result.sink_alignment_null``; None: not computed)."""

    sink_alignment: pd.DataFrame
    null: pd.DataFrame | None = None


class SinkAlignmentAnalysis(LayerMeansAnalysis[SinkAlignmentTables]):
    """Figure 5: per layer, mean cos(ṽ_0, ṽ_j) and cos(ṽ_i, ṽ_j), and the null."""

    name = "sink_alignment"
    stat = SinkAlignment
    prefix = ""  # its columns of per_layer.csv are unprefixed
    attributes = ("sink_alignment", "sink_alignment_null")
    tables = SinkAlignmentTables

    def stats(self, num_layers: int, num_heads: int, options: GeometryOptions) -> dict[str, Stat]:
        return {self.name: SinkAlignment(num_layers, seed=options.seed)}

    def attribute(self, table: SinkAlignmentTables, name: str) -> Any:
        return table.null if name == "sink_alignment_null" else table.sink_alignment

    def build(self, ctx: TableContext) -> SinkAlignmentTables:
        table = super().build(ctx)
        stat = ctx.stats[self.name]
        assert isinstance(stat, SinkAlignment)
        draws = stat.null_draws()
        if draws is not None:
            table.null = null_table(table.sink_alignment, draws)
        return table

    def from_saved(self, saved: SavedRun) -> SinkAlignmentTables | None:
        table = super().from_saved(saved)
        data = (saved.tables.get("sink_alignment") or {}).get("null")
        if table is not None and data:
            table.null = null_from_json(data, "mean", NULL_COLUMNS)
        return table

    def to_json(self, table: SinkAlignmentTables) -> dict[str, Any]:
        frame = table.sink_alignment
        out: dict[str, Any] = {
            "mean": {c: num(frame[c].mean()) for c in COLUMNS},
            "by_layer": records(frame.reset_index()),
        }
        if table.null is not None:
            out["null"] = null_to_json(table.null, "mean", NULL_TOKEN, ALTERNATIVE)
        return {"sink_alignment": out}

    def markdown(self, table: SinkAlignmentTables, result: ResultView) -> list[str]:
        frame = table.sink_alignment
        mean = frame.mean()
        return [
            "## Sink / tail alignment (Figure 5)",
            f"Mean over layers: cos(ṽ_0, ṽ_j) = {mean['sink_tail']:.3f}, "
            f"cos(ṽ_i, ṽ_j) = {mean['tail_tail']:.3f}.",
            "",
            markdown_table(frame.join(result.sink_rate)),
            "",
            *null_markdown(table.null, "mean", _about_null),
        ]


def _about_null(overall: pd.Series) -> str:
    return (
        f"Null: the same cosine with {NULL_TOKEN} (mean over j ≠ c of cos(ṽ_c, ṽ_j)); "
        f"over layers {overall['null_mean']:.3f} ± {overall['null_sd']:.3f}, one-sided "
        f"p = {overall['p_value']:.3f} that the sink is less aligned than a random token."
    )


register_analysis(SinkAlignmentAnalysis())
