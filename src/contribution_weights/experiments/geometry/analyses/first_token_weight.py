"""First-token weight (paper Table 4): E[w_0^(l)] per layer, and its mean over layers.

Per layer and text: the mean over queries of the weight every normalised measure puts on
token 0, summed over heads (method §3); averaged over texts with equal weight, then over
layers. ``per_layer.csv`` has the per-layer values, ``tables.json`` their means.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd

from ....measures.aggregates import first_token_weight
from ...stats import WEIGHT_MEASURES, BlockView, LayerMeans
from ..analysis import LayerMeansAnalysis, markdown_table, num, register_analysis
from ..analysis_types import ResultView


class FirstTokenWeight(LayerMeans):
    """Table 4: E[w_0^(l)] = (1/T) Σ_i Σ_h w_i0 with the registry's normalised weights
    (method §3), via :func:`~....measures.aggregates.first_token_weight` per block."""

    columns = WEIGHT_MEASURES

    def observe(self, view: BlockView) -> None:
        queries = view.alpha.shape[1]
        for k, measure in enumerate(WEIGHT_MEASURES):
            mean = first_token_weight(view.weight(measure), measure)  # over the block
            self._seq[view.layer, k] += float(mean) * queries
        self._seq_n[view.layer] += queries


# ---- the analysis --------------------------------------------------------------------------
@dataclass
class FirstTokenWeightTables:
    """The first-token weight per layer (columns attention, vw, contribution)."""

    first_token_weight_by_layer: pd.DataFrame

    @property
    def first_token_weight(self) -> dict[str, float]:
        """Table 4: the mean over layers of the per-layer first-token weight."""
        return {m: num(self.first_token_weight_by_layer[m].mean()) for m in WEIGHT_MEASURES}


class FirstTokenWeightAnalysis(LayerMeansAnalysis[FirstTokenWeightTables]):
    """Table 4: the first-token weight per layer and its mean over layers."""

    name = "first_token_weight"
    stat = FirstTokenWeight
    tables = FirstTokenWeightTables

    def to_json(self, table: FirstTokenWeightTables) -> dict[str, Any]:
        return {"first_token_weight": table.first_token_weight}

    def markdown(self, table: FirstTokenWeightTables, result: ResultView) -> list[str]:
        mean = pd.DataFrame([table.first_token_weight], index=["E[w_0]"])
        return ["## First-token weight, mean over layers (Table 4)", "", markdown_table(mean), ""]


register_analysis(FirstTokenWeightAnalysis())
