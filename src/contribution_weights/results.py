"""The result object of a trace: tensors, tokens and metadata, with save/load.

A :class:`Trace` holds, for one sequence, a float tensor ``(L, H, T, T)`` per measure
for the traced layers (``layers`` lists which), the bias share ``(L, T)``, the flags of
degenerate queries, the tokens, and metadata. On disk it is a folder:

* ``trace.safetensors``: one tensor per measure name, plus ``bias_share``, the flags
  ``degenerate`` ``(L, T)``, ``degenerate_heads`` and ``zero_values`` ``(L, H, T)``
  (uint8) and ``input_ids``;
* ``tokens.json``: ``{"ids": [...], "tokens": [...]}``;
* ``meta.json``: model name and type, traced layers, dtype, measures;
* ``summary.json``: first-token weight and entropy per weight measure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import Tensor

from .measures import aggregates
from .measures.registry import get_measure


@dataclass
class Trace:
    """Per-layer, per-head measures for one sequence (see module docstring)."""

    measures: dict[str, Tensor]
    input_ids: Tensor
    tokens: list[str]
    layers: list[int]
    bias_share: Tensor
    degenerate: Tensor
    model_name: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    # flags of zero denominators (method §2: the quantity is 0 there, never NaN):
    # degenerate: (L, T) queries with o_i = 0 (ĉ, r, κ, vw_on are 0 on their rows);
    # degenerate_heads: (L, H, T) queries with o_i^(h) = 0 (č is 0 on their rows);
    # zero_values: (L, H, T) keys with ṽ_j^(h) = 0 (κ is 0 in their columns).
    degenerate_heads: Tensor | None = None
    zero_values: Tensor | None = None

    # ---- access ----------------------------------------------------------------------
    def __getitem__(self, name: str) -> Tensor:
        if name not in self.measures:
            raise KeyError(
                f"measure {name!r} was not traced; this trace has: {', '.join(self.measures)}"
            )
        return self.measures[name]

    def __contains__(self, name: object) -> bool:
        return name in self.measures

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_heads(self) -> int:
        return next(iter(self.measures.values())).shape[1]

    def layer_position(self, layer: int) -> int:
        """Index into the first dimension of the tensors for model layer ``layer``."""
        try:
            return self.layers.index(layer)
        except ValueError:
            raise ValueError(
                f"layer {layer} was not traced; traced layers: {self.layers}"
            ) from None

    def weight_measures(self) -> list[str]:
        return [m for m in self.measures if get_measure(m).is_weight]

    # ---- aggregates (method §3) -------------------------------------------------------
    def normalised(self, name: str) -> Tensor:
        return aggregates.normalised(self[name], name)

    def token_scores(self, name: str) -> Tensor:
        """``(L, H, T)``: mean over queries i ≥ j of the measure."""
        return aggregates.token_scores(self[name])

    def first_token_weight(self, name: str) -> Tensor:
        """``(L,)``: per-layer first-token weight of the normalised measure."""
        return aggregates.first_token_weight_of(self[name], name)

    def entropy(self, name: str, exclude_first: bool = False) -> float:
        """Mean over layers and heads of the per-query entropy (paper Table 5)."""
        return float(aggregates.entropy(self[name], exclude_first).mean())

    def summary(self) -> pd.DataFrame:
        """First-token weight and entropy (with and without token 0) per weight measure."""
        rows = []
        for name in self.weight_measures():
            rows.append(
                {
                    "measure": name,
                    "first_token_weight": float(self.first_token_weight(name).mean()),
                    "entropy": self.entropy(name),
                    "entropy_excl_first": self.entropy(name, exclude_first=True)
                    if self.num_tokens > 1
                    else float("nan"),
                }
            )
        return pd.DataFrame(rows).set_index("measure")

    def first_token_weight_by_layer(self) -> pd.DataFrame:
        """Layers × weight measures table of the first-token weight."""
        data = {m: self.first_token_weight(m).tolist() for m in self.weight_measures()}
        return pd.DataFrame(data, index=pd.Index(self.layers, name="layer"))

    def to_dataframe(self, measures: list[str] | None = None) -> pd.DataFrame:
        """Long table: one row per (layer, head, query, key) with key ≤ query."""
        names = list(self.measures) if measures is None else list(measures)
        if not names:
            raise ValueError(
                f"name at least one measure; this trace has: {', '.join(self.measures)}"
            )
        first = self[names[0]]
        n_l, n_h, t, _ = first.shape
        qi, kj = torch.tril_indices(t, t)
        frame: dict[str, Any] = {
            "layer": torch.tensor(self.layers).repeat_interleave(n_h * len(qi)).numpy(),
            "head": torch.arange(n_h).repeat_interleave(len(qi)).repeat(n_l).numpy(),
            "query": qi.repeat(n_l * n_h).numpy(),
            "key": kj.repeat(n_l * n_h).numpy(),
        }
        for name in names:
            frame[name] = self[name][:, :, qi, kj].reshape(-1).numpy()
        return pd.DataFrame(frame)

    # ---- files ---------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {name: t.contiguous() for name, t in self.measures.items()}
        tensors["bias_share"] = self.bias_share.contiguous()
        tensors["degenerate"] = self.degenerate.to(torch.uint8).contiguous()
        for name in ("degenerate_heads", "zero_values"):
            flag = getattr(self, name)
            if flag is not None:
                tensors[name] = flag.to(torch.uint8).contiguous()
        tensors["input_ids"] = self.input_ids.to(torch.int64).contiguous()
        save_file(tensors, str(out / "trace.safetensors"))
        ids = self.input_ids.tolist()
        (out / "tokens.json").write_text(json.dumps({"ids": ids, "tokens": self.tokens}))
        meta = {
            **self.meta,
            "model": self.model_name,
            "layers": self.layers,
            "measures": list(self.measures),
        }
        (out / "meta.json").write_text(json.dumps(meta, indent=2))
        summary = self.summary()
        (out / "summary.json").write_text(json.dumps(summary.to_dict(orient="index"), indent=2))
        return out

    @classmethod
    def load(cls, directory: str | Path) -> Trace:
        from safetensors.torch import load_file

        folder = Path(directory)
        if not (folder / "trace.safetensors").exists():
            raise FileNotFoundError(f"{folder} holds no trace.safetensors; is it a trace folder?")
        tensors = load_file(str(folder / "trace.safetensors"))
        meta = json.loads((folder / "meta.json").read_text())
        tokens = json.loads((folder / "tokens.json").read_text())
        measures = {name: tensors[name] for name in meta["measures"]}
        extra = {k: v for k, v in meta.items() if k not in ("model", "layers", "measures")}
        return cls(
            measures=measures,
            input_ids=tensors["input_ids"],
            tokens=tokens["tokens"],
            layers=list(meta["layers"]),
            bias_share=tensors["bias_share"],
            degenerate=tensors["degenerate"].bool(),
            degenerate_heads=tensors["degenerate_heads"].bool()
            if "degenerate_heads" in tensors
            else None,
            zero_values=tensors["zero_values"].bool() if "zero_values" in tensors else None,
            model_name=meta.get("model", ""),
            meta=extra,
        )

    # ---- interactive report (presentation layer, imported lazily) ---------------------
    def to_html(self, path: str | Path, **kwargs: Any) -> Path:
        """Write the interactive self-contained HTML report; see ``presentation.report``."""
        from .presentation.report import write_report

        return write_report(self, path, **kwargs).path  # type: ignore[return-value]

    def _repr_html_(self) -> str:
        from .presentation.report import notebook_html

        return notebook_html(self)

    def __repr__(self) -> str:
        shape = tuple(next(iter(self.measures.values())).shape) if self.measures else ()
        return (
            f"Trace(model={self.model_name!r}, tokens={self.num_tokens}, "
            f"layers={len(self.layers)}, measures={list(self.measures)}, shape={shape})"
        )
