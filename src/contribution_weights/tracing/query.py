"""One query of a trace read the way a researcher asks: which tokens it draws on, and
whether token 0 is an attention sink.

* :func:`top_tokens`: for a layer and a query, the keys ranked by their share of the
  query's weight summed over heads (the normalised weights of every weight measure sum
  to 1 over heads and keys per query: attention ``α/H``, contribution ``ĉ`` as it is),
  with attention beside contribution and, on request, the share of each head. From the
  maps when the trace kept them (exact); from each head's top-k keys otherwise (a key
  outside a head's top k counts 0 there, said in the table's ``attrs``).
* :func:`sink_table`: per traced layer, the mean attention to token 0 against the
  threshold the geometry analysis uses to call a layer a sink layer, with token 0's
  share of the contribution beside it: high attention with a small contribution is a
  sink, which the head looks at but takes little from.
"""

from __future__ import annotations

from typing import Any, Protocol

import pandas as pd
import torch
from torch import Tensor

from ..defaults import SINK_LAYER_THRESHOLD
from ..measures.aggregates import normalised
from ..measures.reductions import MeasureReductions
from ..measures.registry import get_measure
from .storage import MapStore

#: the pair a query's table puts side by side (whichever of them the trace holds)
SIDE_BY_SIDE = ("contribution", "attention")


class QuerySource(Protocol):
    """What the functions here read (a :class:`~.result.Trace`)."""

    tokens: list[str]
    layers: list[int]
    measures: list[str]
    num_heads: int
    maps: MapStore | None
    meta: dict[str, Any]

    @property
    def num_tokens(self) -> int: ...

    def layer_position(self, layer: int) -> int: ...

    def kept_reductions(self, name: str) -> MeasureReductions: ...

    def first_token_weight(self, name: str) -> Tensor: ...

    def _read(self, name: str, pos: int, heads: slice, rows: slice) -> Tensor: ...


def resolve_layer(trace: QuerySource, layer: int) -> int:
    """A model layer that was traced (negative counts from the model's last layer, as
    ``--layers`` does); a ValueError naming the traced layers otherwise."""
    num_layers = trace.meta.get("num_layers")
    if layer < 0 and isinstance(num_layers, int) and -num_layers <= layer:
        layer += num_layers
    trace.layer_position(layer)  # raises, naming the traced layers
    return layer


def resolve_query(trace: QuerySource, query: int) -> int:
    """A query position, negative counting from the end; a ValueError when out of range."""
    t = trace.num_tokens
    if not -t <= query < t:
        raise ValueError(f"query {query} is out of range: the trace has {t} tokens (0 to {t - 1}, "
                         "or -1 for the last)")  # fmt: skip
    return query % t


def query_shares(trace: QuerySource, name: str, layer: int, query: int) -> tuple[Tensor, bool]:
    """``(H, T)`` normalised weights of one query (each head's share of the query's weight
    per key; the sum over heads and keys is 1), and whether they are exact: from the maps,
    or from reductions that kept every key; False when only each head's top k were kept."""
    if name not in trace.measures:
        raise ValueError(f"measure {name!r} was not traced; this trace has: "
                         f"{', '.join(trace.measures)}")  # fmt: skip
    if not get_measure(name).is_weight:
        raise ValueError(f"{name!r} is not a weight measure: it has no share per token")
    pos = trace.layer_position(layer)
    h = trace.num_heads
    if trace.maps is not None:
        row = trace._read(name, pos, slice(0, h), slice(query, query + 1)).to(torch.float64)
        return normalised(row, name)[:, 0, :], True
    r = trace.kept_reductions(name)
    if r.top_values is None or r.top_keys is None:
        raise ValueError(f"this trace kept no maps and no top keys of {name!r} (top_k=0); "
                         "trace again with maps, or with --top-k 8 or more")  # fmt: skip
    first, total = r.first[pos, :, query].double(), r.row_sum[pos, :, query].double()
    folded = torch.stack([first, total - first], dim=-1)[:, None, :]  # (H, 1, 2)
    whole = float(folded.sum())
    # every registered normalisation scales a query by one factor from its sums
    factor = float(normalised(folded, name).sum()) / whole if whole != 0 else 1.0
    values = r.top_values[pos, :, query].double() * factor
    keys = r.top_keys[pos, :, query].long()
    shares = torch.zeros(h, trace.num_tokens, dtype=torch.float64)
    kept = keys >= 0
    heads = torch.arange(h)[:, None].expand_as(keys)
    shares[heads[kept], keys[kept]] = values[kept]
    return shares, r.top_keys.shape[-1] >= query + 1


def top_tokens(
    trace: QuerySource,
    layer: int,
    query: int = -1,
    k: int = 8,
    measure: str = "contribution",
    heads: bool = False,
    exclude_first: bool = False,
) -> pd.DataFrame:
    """The ``k`` keys that the query draws on most at a model layer, by the size of
    their share of ``measure`` summed over heads (a signed measure's negative shares count
    by their size).

    Columns: ``position``, ``token``, ``measure``'s share, the share of the other of
    attention and contribution where the trace holds it, and with ``heads`` one column a
    head (``h0``, ``h1``, …: the head's part of the share, so that they add up to it).
    ``attrs``: ``layer``, ``query``, ``measure``, ``exact`` (False for a trace without maps
    whose top-k per head did not keep every key: a key outside a head's top k then counts
    0 there) and ``first`` (token 0's share by each measure shown, whether it is in the
    table or not). ``exclude_first`` leaves token 0 out of the ranking.
    """
    if k < 1:
        raise ValueError(f"k must be at least 1, not {k}")
    layer = resolve_layer(trace, layer)
    query = resolve_query(trace, query)
    names = [measure] + [m for m in SIDE_BY_SIDE if m != measure and m in trace.measures]
    shares, exact = {}, True
    for name in names:
        shares[name], ok = query_shares(trace, name, layer, query)
        exact = exact and ok
    total = shares[measure].sum(0)
    order = torch.argsort(total[: query + 1].abs(), descending=True, stable=True)
    if exclude_first:
        order = order[order != 0]
    order = order[:k]
    rows = {
        "position": order.tolist(),
        "token": [trace.tokens[j] for j in order.tolist()],
    }
    for name in names:
        rows[name] = shares[name].sum(0)[order].tolist()
    if heads:
        for hh in range(trace.num_heads):
            rows[f"h{hh}"] = shares[measure][hh, order].tolist()
    table = pd.DataFrame(rows)
    table.attrs.update(
        layer=layer,
        query=query,
        measure=measure,
        exact=exact,
        first={name: float(shares[name][:, 0].sum()) for name in names},
    )
    return table


def sink_table(trace: QuerySource, threshold: float = SINK_LAYER_THRESHOLD) -> pd.DataFrame:
    """Per traced layer (the index): ``attention_to_first``, the mean over queries and
    heads of the attention to token 0; ``contribution_of_first``, token 0's mean share of
    the contribution (NaN when contribution was not traced); ``sink``, whether the
    attention to token 0 is above ``threshold`` (the geometry analysis's sink-layer
    threshold by default). A ValueError when attention was not traced."""
    if "attention" not in trace.measures:
        raise ValueError("the sink verdict needs the attention measure, which this trace "
                         "lacks; trace again with --measures attention,contribution")  # fmt: skip
    attention = trace.first_token_weight("attention").double()
    if "contribution" in trace.measures:
        contribution = trace.first_token_weight("contribution").double()
    else:
        contribution = torch.full_like(attention, float("nan"))
    table = pd.DataFrame(
        {
            "attention_to_first": attention.tolist(),
            "contribution_of_first": contribution.tolist(),
            "sink": (attention > threshold).tolist(),
        },
        index=pd.Index(trace.layers, name="layer"),
    )
    table.attrs["threshold"] = threshold
    return table
