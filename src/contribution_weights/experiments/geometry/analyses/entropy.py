"""Entropy of the weights (paper Table 5), over all tokens and without token 0.

Per layer and text: the mean over heads and queries of the entropy of each normalised
measure's row, and the same with token 0 (and query 0) left out; averaged over texts,
then over layers. ``per_layer.csv`` has the per-layer values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch

from ....measures.aggregates import entropy
from ...stats import WEIGHT_MEASURES, BlockView, LayerMeans
from ..analysis import LayerMeansAnalysis, markdown_table, num, register_analysis
from ..analysis_types import ResultView

ROWS = ("all", "excluding_first")


class Entropy(LayerMeans):
    """Table 5: mean over heads and queries of the entropy, with and without token 0.

    Uses :func:`~....measures.aggregates.entropy` per block; without token 0, query 0 is
    dropped too (it has no other key), which only the block starting at query 0 holds.
    """

    columns = tuple(f"{m}:{v}" for v in ROWS for m in WEIGHT_MEASURES)

    def observe(self, view: BlockView) -> None:
        h, queries = view.alpha.shape[:2]
        later = queries - 1 if view.first_block else queries  # queries i ≥ 1
        valid = view.lt.valid[0].expand_as(view.alpha)
        for k, measure in enumerate(WEIGHT_MEASURES):
            w = view.weight(measure)
            w = torch.where(valid, w, torch.zeros((), dtype=w.dtype))
            self._seq[view.layer, k] += float(entropy(w).sum()) * queries
            self._seq_n[view.layer, k] += h * queries
            if later:
                excl = entropy(w, exclude_first=True) if view.first_block else entropy(w[..., 1:])
                self._seq[view.layer, k + len(WEIGHT_MEASURES)] += float(excl.sum()) * later
                self._seq_n[view.layer, k + len(WEIGHT_MEASURES)] += h * later


# ---- the analysis --------------------------------------------------------------------------
@dataclass
class EntropyTables:
    """The entropy per layer (columns ``measure:all``, ``measure:excluding_first``) and its
    mean over layers (rows all / excluding_first, columns the measures)."""

    entropy_by_layer: pd.DataFrame

    @property
    def entropy(self) -> pd.DataFrame:
        """Table 5: the mean over layers, rows all / excluding_first, columns the measures."""
        means = self.entropy_by_layer.mean()
        return pd.DataFrame(
            {m: [means[f"{m}:{row}"] for row in ROWS] for m in WEIGHT_MEASURES}, index=list(ROWS)
        )


class EntropyAnalysis(LayerMeansAnalysis[EntropyTables]):
    """Table 5: entropy of each weight measure, with and without token 0."""

    name = "entropy"
    stat = Entropy
    tables = EntropyTables

    def to_json(self, table: EntropyTables) -> dict[str, Any]:
        t = table.entropy
        return {"entropy": {row: {m: num(t.loc[row, m]) for m in WEIGHT_MEASURES} for row in ROWS}}

    def markdown(self, table: EntropyTables, result: ResultView) -> list[str]:
        return ["## Entropy (Table 5)", "", markdown_table(table.entropy), ""]


register_analysis(EntropyAnalysis())
