"""The ``attribution-eval`` run: its units and phases (:class:`AttributionEval`), the
rankings and removal sets of the curves, and the :class:`Editor` that scores an item with
tokens removed (the package's docstring says what a unit computes).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ...attribution.methods import METHODS
from ...attribution.options import AttributeOptions
from ...attribution.run import method_function
from ...attribution.targets import Target, target_values
from ...attribution.tasks import KNOWN_ANSWER, Item, make_item, text_item
from ...loading import LoadedModel
from ...runs import fingerprint
from ..runner import Experiment, Phase, SkipUnit, run_experiment
from .options import AttributionEvalOptions
from .tables import COLUMNS, MODES, AttributionEvalResult, added_file


def ranking_order(name: str, scores: dict[str, Tensor], candidates: Tensor, item: int,
                  seed: int) -> Tensor:  # fmt: skip
    """The candidates, most important first, by a method's scores or a baseline."""
    if name == "recency":
        return candidates.flip(0)
    if name.startswith("random:"):
        rng = np.random.default_rng([seed, item, int(name.split(":")[1]), 7])
        return candidates[torch.from_numpy(rng.permutation(candidates.numel()))]
    row = scores[name][candidates]
    # ties broken by position, latest first, so that a constant score is recency
    order = sorted(range(candidates.numel()), key=lambda k: (-float(row[k]), -k))
    return candidates[torch.tensor(order, dtype=torch.long)]


def removal_sets(order: Tensor, rates: Sequence[float]) -> list[tuple[str, float, Tensor]]:
    """(mode, rate, positions removed) for every mode and rate (module docstring)."""
    n = order.numel()
    out = []
    for rate in rates:
        k = min(n, max(1, math.ceil(rate * n)))
        out.append(("comprehensiveness", rate, order[:k]))
        out.append(("sufficiency", rate, order[n - k :]))
        out.append(("insertion", rate, order[k:]))
    return out


class Editor:
    """Log-probabilities of an item's answer with sets of tokens removed, in batches."""

    def __init__(self, model: LoadedModel, batch_size: int) -> None:
        self.model = model
        self.batch_size = batch_size
        self._neutral: Tensor | None = None

    @property
    def neutral(self) -> Tensor:
        """The mean input embedding over the vocabulary (as the model scales it)."""
        if self._neutral is None:
            embed = self.model.model.get_input_embeddings()
            vocab = int(embed.weight.shape[0])
            total = None
            with torch.no_grad():
                for start in range(0, vocab, 8192):
                    ids = torch.arange(start, min(vocab, start + 8192), device=self.model.device)
                    part = embed(ids).double().sum(0)
                    total = part if total is None else total + part
            assert total is not None
            self._neutral = (total / vocab).to(embed.weight.dtype)
        return self._neutral

    def values(
        self, ids: Tensor, answer: int, removed: Sequence[Tensor], intervention: str
    ) -> list[float]:
        """log P(answer) at the last position with each set of positions removed; a set
        that occurs more than once (two rankings that agree on their top tokens at a rate)
        runs once."""
        keys = [tuple(sorted(int(x) for x in positions.tolist())) for positions in removed]
        distinct = list(dict.fromkeys(keys))
        got = dict(zip(distinct, self._values(ids, answer, distinct, intervention), strict=True))
        return [got[k] for k in keys]

    def _values(
        self, ids: Tensor, answer: int, removed: Sequence[tuple[int, ...]], intervention: str
    ) -> list[float]:
        out: list[float] = []
        t = ids.numel()
        device = self.model.device
        embed = self.model.model.get_input_embeddings()
        for start in range(0, len(removed), self.batch_size):
            chunk = removed[start : start + self.batch_size]
            keep = torch.ones(len(chunk), t, dtype=torch.long, device=device)
            for row, positions in enumerate(chunk):
                keep[row, torch.tensor(positions, dtype=torch.long, device=device)] = 0
            batch = ids[None].to(device).expand(len(chunk), t)
            kwargs: dict[str, Any] = {"use_cache": False, **self.model.last_logits_only()}
            with torch.no_grad():
                if intervention == "key_mask":
                    logits = self.model.model(
                        input_ids=batch, attention_mask=keep, **kwargs
                    ).logits[:, -1]
                else:
                    embeds = embed(batch).clone()
                    gone = keep == 0
                    embeds[gone] = self.neutral.to(embeds.dtype)
                    logits = self.model.model(inputs_embeds=embeds, **kwargs).logits[:, -1]
            out += torch.log_softmax(logits.float(), -1)[:, answer].tolist()
        return out


class AttributionEval(Experiment["AttributionEvalResult"]):
    name = "attribution-eval"
    extendable = ("added_methods",)

    def __init__(
        self,
        model: LoadedModel,
        texts: Sequence[str] | None,
        options: AttributionEvalOptions,
        batch_size: int | None = None,
    ) -> None:
        self.model, self.options = model, options
        self.items = self._items(texts)
        self.editor = Editor(model, batch_size or 16)
        self.attribute_options = AttributeOptions(steps=options.steps)

    def _items(self, texts: Sequence[str] | None) -> list[Item]:
        o = self.options
        tok = self.model.tokenizer
        if o.task in KNOWN_ANSWER:
            return [make_item(o.task, tok, i, o.seed, o.tokens, o.generator) for i in range(o.n)]
        if not texts:
            raise ValueError("the deletion task needs texts: --dataset NAME or --texts FILE")
        items = []
        for text in texts:
            item = text_item(tok, text, o.tokens)
            if item is not None:
                items.append(item)
            if len(items) == o.n:
                break
        if not items:
            raise ValueError(
                f"no text has {o.tokens + 1} tokens or more; pass longer texts or a smaller "
                "--tokens"
            )
        return items

    def adopt(self, held: dict[str, Any]) -> None:
        """The methods added to the run before stay added; new ones come after them."""
        earlier = list(held.get("added_methods") or [])
        given = self.options.added_methods
        self.options.added_methods = earlier + [m for m in given if m not in earlier]

    def config(self) -> dict[str, Any]:
        return {
            "experiment": self.name,
            "model": self.model.name,
            **self.options.to_dict(),
            "items_sha256": fingerprint([",".join(map(str, i.ids)) for i in self.items]),
        }

    @property
    def rows_per_unit(self) -> int:
        return len(self.options.methods) + len(self.options.rankings()) * self._curves_per_ranking

    @property
    def _curves_per_ranking(self) -> int:
        return len(self.options.interventions) * len(MODES) * len(self.options.rates)

    @property
    def baseline_rankings(self) -> list[str]:
        """The rankings that are not methods (``random:SEED`` per seed, ``recency``)."""
        return [r for r in self.options.rankings() if r not in self.options.methods]

    def baseline_hits(self, index: int) -> list[dict[str, Any]]:
        """The baselines' hits on a known-answer item: the source's rank in each baseline's
        order of the candidates, the orders the curves remove by. Under sink protection
        token 0 is not a candidate and has no place in their orders, so ``rank_all`` is
        NaN; without it the candidates are every position and ``rank_all`` is ``rank``."""
        o, item = self.options, self.items[index]
        candidates = self._candidates(item)
        base = {"item": index, "kind": "hit", "tokens": len(item.ids)}
        rows = []
        for name in self.baseline_rankings:
            order = ranking_order(name, {}, candidates, index, o.seed).tolist()
            rank = 1 + min(order.index(s) for s in item.sources)
            rank_all = math.nan if o.protect_first else rank
            rows.append({**base, "measure": name, **_rank_fields(rank, rank_all)})
        return [{c: row.get(c, "") for c in COLUMNS} for row in rows]

    def _candidates(self, item: Item) -> Tensor:
        """The positions a ranking orders: every one before the target's, token 0 only
        without sink protection (the curves' and the hits' candidates)."""
        first = 1 if self.options.protect_first else 0
        candidates = torch.arange(first, item.position, dtype=torch.long)
        if candidates.numel() < 2:
            raise SkipUnit("fewer than 2 candidate tokens")
        return candidates

    def run(self, index: int) -> list[dict[str, Any]]:
        """One item: every method's scores and hits, then every ranking's curves."""
        return self._unit(index, self.options.methods, self.options.rankings())

    def run_added(self, method: str, index: int) -> list[dict[str, Any]]:
        """One item for a method added to the run: its hits and its own curves (the
        baselines' and the run's methods' are in ``rows.csv`` already)."""
        return self._unit(index, [method], [method])

    def _unit(self, index: int, methods: Sequence[str], rankings: Sequence[str]
              ) -> list[dict[str, Any]]:  # fmt: skip
        o = self.options
        item = self.items[index]
        ids = torch.tensor(item.ids, dtype=torch.long)
        t = ids.numel()
        target = Target(item.position, item.answer, "logprob")
        with torch.no_grad():
            logits = self.model.model(
                input_ids=ids[None].to(self.model.device),
                use_cache=False,
                **self.model.last_logits_only(),
            ).logits[0, -1:]
        full = float(target_values(logits.float(), [target])[0])
        if not math.isfinite(full):
            raise SkipUnit("the answer's log-probability is not finite")
        correct = float(int(logits[0].argmax()) == item.answer)
        base = {"item": index, "value_full": full, "correct": correct, "tokens": t}
        rows: list[dict[str, Any]] = []
        scores: dict[str, Tensor] = {}
        spent: dict[str, float] = {}
        # a magnitude twin after its method, whatever the listed order, so it takes the
        # method's scores (and seconds) instead of running it again
        for name in sorted(methods, key=lambda m: bool(METHODS.get(m).absolute_of)):
            signed = METHODS.get(name).absolute_of
            if signed in scores:  # a magnitude twin of a method that ran: its scores, free
                scores[name], seconds = scores[signed].abs(), spent[signed]
            else:
                start = time.perf_counter()
                out = method_function(name)(self.model, ids, [target], self.attribute_options)
                seconds = time.perf_counter() - start
                scores[name] = out.scores[0].detach().double().cpu()
            spent[name] = seconds
            rows.append({**base, "kind": "hit", "measure": name, "seconds": seconds,
                         **self._hits(scores[name], item, o.protect_first)})  # fmt: skip
        candidates = self._candidates(item)
        for how in o.interventions:
            for name in rankings:
                order = ranking_order(name, scores, candidates, index, o.seed)
                sets = removal_sets(order, o.rates)
                values = self.editor.values(ids, item.answer, [s for _, _, s in sets], how)
                for (mode, rate, _), value in zip(sets, values, strict=True):
                    rows.append({**base, "kind": "curve", "measure": name, "intervention": how,
                                 "mode": mode, "rate": rate, "value": value,
                                 "delta": full - value})  # fmt: skip
        return [{c: row.get(c, "") for c in COLUMNS} for row in rows]

    @staticmethod
    def _hits(scores: Tensor, item: Item, protect_first: bool) -> dict[str, float]:
        """The source's rank among the candidates of the curves (every position but the
        target's, and token 0 under sink protection), its top-1 and top-5 hits, and its
        rank among all positions but the target's (``rank_all``: token 0 competing)."""
        if not item.sources:
            return {"rank": math.nan, "hit1": math.nan, "hit5": math.nan, "rank_all": math.nan}

        def rank_among(first: int) -> int:
            order = sorted(range(first, item.position), key=lambda j: (-float(scores[j]), -j))
            return 1 + min(order.index(s) for s in item.sources)

        return _rank_fields(rank_among(1 if protect_first else 0), rank_among(0))

    def phases(self) -> Iterator[Phase]:
        yield self._item_phase(
            "attribution-eval", self.run, AttributionEvalResult.ROWS, self.rows_per_unit
        )
        if self.options.task in KNOWN_ANSWER and self.baseline_rankings:
            yield self._item_phase(
                "baseline-hits",
                self.baseline_hits,
                AttributionEvalResult.BASELINE_HITS,
                len(self.baseline_rankings),
            )
        for method in self.options.added_methods:
            yield self._item_phase(
                f"added {method}",
                functools.partial(self.run_added, method),
                added_file(method),
                1 + self._curves_per_ranking,
            )

    def _item_phase(
        self,
        name: str,
        run: Callable[[int], list[dict[str, Any]]],
        rows_file: str,
        rows_per_unit: int,
    ) -> Phase:
        """A phase of the run: a unit per item, its rows in ``rows_file`` keyed by item."""
        return Phase(
            name, range(len(self.items)), run, rows_file=rows_file, key="item",
            rows_per_unit=rows_per_unit,
        )  # fmt: skip

    def result(
        self, rows: Mapping[str, Sequence[Mapping[str, Any]]], run_info: dict[str, Any]
    ) -> AttributionEvalResult:
        return AttributionEvalResult.from_rows(rows, self.config(), run_info)


def _rank_fields(rank: int, rank_all: float) -> dict[str, float]:
    """A hit row's fields from the source's rank among the candidates and among all
    positions (NaN where not defined)."""
    return {"rank": float(rank), "hit1": float(rank == 1), "hit5": float(rank <= 5),
            "rank_all": float(rank_all)}  # fmt: skip


def attribution_eval(
    model: LoadedModel,
    texts: Sequence[str] | None = None,
    *,
    options: AttributionEvalOptions | None = None,
    out: str | Path | None = None,
    resume: bool = False,
    source: str = "",
    batch_size: int | None = None,
) -> AttributionEvalResult:
    """Evaluate end-to-end attributions (the package docstring); resumable with ``out``."""
    experiment = AttributionEval(model, texts, options or AttributionEvalOptions(), batch_size)
    return run_experiment(experiment, out, resume=resume)
