"""The result of an attribution: per method and target, a score for every input token."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .targets import Target

FILE = "attribution.json"
ROUTES_FILE = "routes.json"


@dataclass
class Edge:
    """A piece of the flow: token ``source`` at level ``layer`` (the input of decoder layer
    ``layer``) into token ``target`` at level ``layer + 1``, through ``head`` (−1: the
    residual stream), carrying ``weight`` (method §7.4)."""

    layer: int
    source: int
    target: int
    head: int
    weight: float


@dataclass
class Routes:
    """The routes of one target: the flow graph's edges above a threshold, top down."""

    target: int  # index into Attribution.targets
    position: int
    threshold: float  # absolute: edges with |weight| >= threshold were kept
    edges: list[Edge]
    num_layers: int

    def nodes(self) -> list[tuple[int, int]]:
        """(level, position) of every node an edge touches, the target's included."""
        seen = {(self.num_layers, self.position)}
        for e in self.edges:
            seen.add((e.layer, e.source))
            seen.add((e.layer + 1, e.target))
        return sorted(seen)

    def graph_data(self, tokens: list[str]) -> dict[str, Any]:
        """The routes as networkx node-link data (``networkx.node_link_graph(data,
        edges="edges")`` reads it): nodes ``"L{level}:{position}"``, one edge per head."""
        return {
            "directed": True,
            "multigraph": True,
            "graph": {
                "target": self.target,
                "target_position": self.position,
                "threshold": self.threshold,
            },
            "nodes": [
                {"id": f"L{lvl}:{pos}", "level": lvl, "position": pos, "token": tokens[pos]}
                for lvl, pos in self.nodes()
            ],
            "edges": [
                {
                    "source": f"L{e.layer}:{e.source}",
                    "target": f"L{e.layer + 1}:{e.target}",
                    "key": e.head,
                    "head": e.head,
                    "weight": e.weight,
                }
                for e in self.edges
            ],
        }


@dataclass
class Attribution:
    """Which input tokens drove each target, by each method.

    Attributes:
        model: the model's name.
        tokens: the text of every token of the input (continuation included).
        ids: the token ids.
        targets: what is explained (resolved: every token known).
        target_tokens: the text of each target's token (and foil, for contrasts).
        values: each target's exact value (log-probability, logit, logit difference; NaN
            for a pure flow).
        scores: per method, ``(n_targets, T)``: the score of every input token.
        explained: per method, the value its scores decompose (flow: z_t − Σ P z for
            logprob, the logit itself for logit; NaN where a method decomposes nothing).
        remainder: per method, the part no token receives (biases; 0 in bias-free models).
        seconds: per method, the wall time.
        routes: the flow's routes per target, when asked for.
    """

    model: str
    tokens: list[str]
    ids: list[int]
    targets: list[Target]
    target_tokens: list[str]
    values: list[float]
    scores: dict[str, Tensor]
    explained: dict[str, list[float]] = field(default_factory=dict)
    remainder: dict[str, list[float]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    routes: list[Routes] | None = None

    @property
    def methods(self) -> list[str]:
        return list(self.scores)

    def __getitem__(self, method: str) -> Tensor:
        """``(n_targets, T)`` scores of one method."""
        if method not in self.scores:
            raise KeyError(
                f"no {method!r} scores in this attribution; it has {', '.join(self.scores)}"
            )
        return self.scores[method]

    def top(
        self,
        k: int = 10,
        method: str | None = None,
        target: int = 0,
        exclude_first: bool = True,
    ) -> list[tuple[int, str, float]]:
        """The ``k`` tokens that drive the target most, by the size of their score (a
        token that pushes the target down counts as much as one that pushes it up), among
        the positions up to the target's own (no later token can drive it):
        ``(position, text, signed score)``.

        ``exclude_first`` (default True) leaves token 0 out, as the known-answer and
        deletion evaluations do (their sink protection): token 0 is the attention sink
        of most models, every later state carries it, so most methods give it a large
        score that says the model needs a first token rather than which of the text's
        tokens drive the target; removing it breaks the model rather than the text. Pass
        False to rank it with the others."""
        name = method or self.methods[0]
        row = self[name][target][: self.targets[target].position + 1]
        order = torch.argsort(row.abs(), descending=True, stable=True)
        if exclude_first:
            order = order[order != 0]
        return [(int(j), self.tokens[int(j)], float(row[j])) for j in order[:k]]

    def describe_target(self, k: int) -> str:
        t = self.targets[k]
        text = self.target_tokens[k]
        if t.quantity == "flow":
            return f"flow of position {t.position} (next token {text!r})"
        value = self.values[k]
        shown = text if t.quantity == "contrast" else repr(text)  # a contrast's are quoted
        return f"{t.quantity} of {shown} after position {t.position} = {value:.4g}"

    def sign_convention(self, k: int) -> str:
        """What a score's sign means for target ``k``, as the figures state it: a positive
        score pushes the target's quantity up. A magnitude twin (``NAME_abs``) drops the
        sign: how much a token mattered, whichever way."""
        t = self.targets[k]
        text = self.target_tokens[k]
        if t.quantity == "flow":
            return f"red: carries position {t.position}'s flow, blue: opposes it"
        if t.quantity == "contrast":
            return f"red: favours {text}, blue: the other way"
        what = "log P" if t.quantity == "logprob" else "the logit"
        return f"red: raises {what} of {text!r}, blue: lowers it"

    def summary(self, k: int = 8) -> str:
        """A few lines per target: its value and each method's top tokens (token 0 left
        out, as :meth:`top` leaves it by default)."""
        lines = ["top tokens by |score|, token 0 (the attention sink) aside:"]
        for i in range(len(self.targets)):
            lines.append(f"target {i}: {self.describe_target(i)}")
            for name in self.methods:
                tops = ", ".join(
                    f"{text!r}@{pos} {s:+.3g}" for pos, text, s in self.top(k, name, i)
                )
                extra = ""
                if name in self.explained and not math.isnan(self.explained[name][i]):
                    extra = (
                        f"  [scores add up to {self.explained[name][i]:.4g}, the target's "
                        f"linear part; remainder {self.remainder[name][i]:.2g}]"
                    )
                lines.append(f"  {name} ({self.seconds.get(name, 0):.2f} s): {tops}{extra}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"Attribution({len(self.tokens)} tokens, {len(self.targets)} target(s), "
            f"methods {', '.join(self.methods)})"
        )

    # ---- the folder format ------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "tokens": self.tokens,
            "ids": self.ids,
            "targets": [
                {"position": t.position, "token": t.token, "quantity": t.quantity, "foil": t.foil}
                for t in self.targets
            ],
            "target_tokens": self.target_tokens,
            "values": [_num(v) for v in self.values],
            "scores": {m: s.double().tolist() for m, s in self.scores.items()},
            "explained": {m: [_num(v) for v in vs] for m, vs in self.explained.items()},
            "remainder": {m: [_num(v) for v in vs] for m, vs in self.remainder.items()},
            "seconds": self.seconds,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Attribution:
        return cls(
            model=data["model"],
            tokens=list(data["tokens"]),
            ids=[int(i) for i in data["ids"]],
            targets=[Target(**t) for t in data["targets"]],
            target_tokens=list(data["target_tokens"]),
            values=[_float(v) for v in data["values"]],
            scores={m: torch.tensor(s, dtype=torch.float64) for m, s in data["scores"].items()},
            explained={m: [_float(v) for v in vs] for m, vs in data["explained"].items()},
            remainder={m: [_float(v) for v in vs] for m, vs in data["remainder"].items()},
            seconds={m: float(v) for m, v in data["seconds"].items()},
        )

    def save(self, folder: str | Path) -> list[Path]:
        """Write ``attribution.json`` (and ``routes.json``, node-link graphs) to ``folder``;
        a ``routes.json`` left there by an earlier attribution with routes is removed when
        this one has none, so that :meth:`load` never pairs it with these scores."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        paths = [folder / FILE]
        paths[0].write_text(json.dumps(self.to_dict()))
        if self.routes is not None:
            graphs = [r.graph_data(self.tokens) for r in self.routes]
            (folder / ROUTES_FILE).write_text(json.dumps(graphs, indent=1))
            paths.append(folder / ROUTES_FILE)
        else:
            (folder / ROUTES_FILE).unlink(missing_ok=True)
        return paths

    @classmethod
    def load(cls, folder: str | Path) -> Attribution:
        path = Path(folder) / FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: no attribution was saved there")
        out = cls.from_dict(json.loads(path.read_text()))
        routes_path = Path(folder) / ROUTES_FILE
        if routes_path.is_file():
            out.routes = [_routes_from_graph(g) for g in json.loads(routes_path.read_text())]
        return out


def _routes_from_graph(data: dict[str, Any]) -> Routes:
    levels = [n["level"] for n in data["nodes"]]
    edges = []
    for e in data["edges"]:
        layer = int(e["source"].split(":")[0][1:])
        edges.append(
            Edge(
                layer,
                int(e["source"].split(":")[1]),
                int(e["target"].split(":")[1]),
                int(e["head"]),
                float(e["weight"]),
            )
        )
    graph = data["graph"]
    return Routes(
        int(graph["target"]),
        int(graph["target_position"]),
        float(graph["threshold"]),
        edges,
        max(levels),
    )


def _num(value: float) -> float | None:
    return None if value is None or math.isnan(value) else float(value)


def _float(value: float | None) -> float:
    return float("nan") if value is None else float(value)
