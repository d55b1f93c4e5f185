"""The kv-eval experiment for the runner (:class:`KVEval`: one unit per item) and its entry
point :func:`kv_eval`: per item one scored prefill, then per (method, ratio) a compressed
copy of the cache scored by the task, its rows with what the compression cost."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ...kv import CompressedCache, compress, prefill
from ...kv.cache import stackable
from ...kv.evaluate import lm_item, lm_items, lm_score, passkey_items, passkey_score
from ...kv.ruler import RulerItem, ruler_items, ruler_scores
from ...loading import LoadedModel
from ...runs import fingerprint
from ..result import warn_few_samples
from ..runner import Experiment, Phase, run_experiment
from .options import NO_COMPRESSION, KVEvalOptions
from .result import PER_ITEM, KVEvalResult


def _items(model: LoadedModel, opts: KVEvalOptions, texts: Sequence[str] | None) -> Iterator[Any]:
    if opts.task == "passkey":
        yield from passkey_items(model, opts.context_tokens, opts.n, opts.seed)
    elif opts.task == "ruler":
        assert isinstance(opts.ruler_tasks, list)
        yield from ruler_items(
            model, opts.ruler_tasks, opts.context_tokens, opts.n, opts.seed, texts
        )
    else:
        assert texts is not None
        for ids in lm_items(model, texts, opts.context_tokens, opts.n):
            yield lm_item(ids, opts.context_tokens)


def cost(small: CompressedCache, seconds: float) -> dict[str, float]:
    """What a compression costs: ``compress_s``, the seconds to score and evict (the
    prefill that gathered the statistics is shared by every method and counted apart, as
    ``prefill_s``), and ``kept_mib``, the MiB of keys and values the compressed layers
    store (padded slots of head-adaptive methods included)."""
    stored = 0
    for idx, kept in small.kept.items():  # the cache may since hold continuation tokens too
        layer = small.cache.layers[idx]
        for x in (layer.keys, layer.values):
            stored += x[..., : kept.shape[-1], :].numel() * x.element_size()
    return {"compress_s": round(seconds, 4), "kept_mib": round(stored / 2**20, 4)}


def first_token_kept(kept: dict[int, torch.Tensor]) -> float:
    """Fraction of (layer, KV head) kept sets that hold position 0 (the usual sink)."""
    flags = [(k == 0).any(-1).float().mean() for k in kept.values()]
    return round(float(torch.stack(flags).mean()), 4) if flags else 1.0


def item_rows(model: LoadedModel, item: Any, opts: KVEvalOptions) -> list[dict[str, Any]]:
    """One row per (method, ratio) configuration of one item (ruler: per (setting, method,
    ratio))."""
    if opts.task == "ruler":
        return ruler_rows(model, item, opts)
    context = item.context if opts.task == "passkey" else item[0]
    started = time.perf_counter()
    pre = prefill(model, context, opts.window, seed=opts.seed, methods=opts.methods)
    prefill_s = time.perf_counter() - started
    rows = []
    for method, ratio in opts.configurations():
        started = time.perf_counter()
        small = compress(pre, "h2o" if method == NO_COMPRESSION else method, ratio)
        spent = time.perf_counter() - started
        if opts.task == "passkey":
            scores = passkey_score(model, small, item)
            extra = {"depth": item.depth}
        else:
            scores = lm_score(model, small, item[1])
            extra = {}
        rows.append(
            {
                "method": method,
                "ratio": ratio,
                **extra,
                **scores,
                "first_token_kept": first_token_kept(small.kept),
                "prefill_s": round(prefill_s, 3),
                **cost(small, spent),
            }
        )
    return rows


#: (method, ratio) configurations of one ruler item generated together, as the rows of one
#: batch (same ratio, equal counts per head): each generated token then reads the model's
#: weights once for all of them. Memory: at most this many compressed caches are held (the
#: largest group generates when they are that many), besides the prefill's cache.
GENERATE_BATCH = 12


def ruler_rows(model: LoadedModel, item: RulerItem, opts: KVEvalOptions) -> list[dict[str, Any]]:
    """Per setting one prefill (the context, or the context and the question), then per
    (method, ratio) a compressed copy, greedy generation and RULER's score. Configurations
    whose caches stack (:func:`~...kv.cache.stackable`: the same ratio, no head-adaptive
    padding) generate together, up to :data:`GENERATE_BATCH` at a time; rows come out in
    the order of :meth:`KVEvalOptions.configurations`."""
    return [row for setting in opts.settings for row in _setting_rows(model, item, opts, setting)]


def _setting_rows(
    model: LoadedModel, item: RulerItem, opts: KVEvalOptions, setting: str
) -> list[dict[str, Any]]:
    ids = item.prefill_ids(setting)
    started = time.perf_counter()
    pre = prefill(model, ids, opts.window, seed=opts.seed, methods=opts.methods)
    prefill_s = time.perf_counter() - started
    configs = opts.configurations()
    done: dict[int, dict[str, Any]] = {}
    pending: dict[Any, list[tuple[int, CompressedCache, float]]] = {}

    def flush(key: Any) -> None:
        group = pending.pop(key)
        scores = ruler_scores(model, [small for _, small, _ in group], item, setting)
        for (k, small, spent), score in zip(group, scores, strict=True):
            method, ratio = configs[k]
            done[k] = {
                "setting": setting,
                "method": method,
                "ratio": ratio,
                "depth": item.meta.get("depth", float("nan")),
                "accuracy": score["accuracy"],
                "answers": "|".join(item.answers),
                "output": score["output"].replace("\n", "\\n"),  # one CSV line
                "first_token_kept": first_token_kept(small.kept),
                "prefill_tokens": int(ids.shape[1]),
                "prefill_s": round(prefill_s, 3),
                **cost(small, spent),
            }

    for k, (method, ratio) in enumerate(configs):
        started = time.perf_counter()
        small = compress(pre, "h2o" if method == NO_COMPRESSION else method, ratio)
        spent = time.perf_counter() - started
        key = stackable(small)
        key = ("alone", k) if key is None else key
        pending.setdefault(key, []).append((k, small, spent))
        if key[0] == "alone" or len(pending[key]) >= GENERATE_BATCH:
            flush(key)
        elif sum(map(len, pending.values())) >= GENERATE_BATCH:  # bound what is held
            flush(max(pending, key=lambda g: len(pending[g])))
    for key in list(pending):
        flush(key)
    return [done[k] for k in range(len(configs))]


class KVEval(Experiment["KVEvalResult"]):
    """The kv-eval experiment for the runner: one unit per item (prefill once, then every
    (method, ratio) configuration), its rows to ``per_item.csv``."""

    name = "kv-eval"

    def __init__(
        self,
        model: LoadedModel,
        texts: Sequence[str] | None,
        opts: KVEvalOptions,
        source: str | None = None,
    ) -> None:
        self.model, self.opts = model, opts
        self.items = list(_items(model, opts, texts))  # at most n items: tokens only
        self._config = {
            "experiment": "kv-eval",
            "model": model.name,
            **opts.to_dict(),
            "texts_sha256": fingerprint(texts or []),
            "source": source or opts.task,
        }

    def config(self) -> dict[str, Any]:
        return self._config

    def phases(self) -> Iterator[Phase]:
        yield Phase(
            name="kv-eval",
            units=range(len(self.items)),
            run=self._item,
            rows_file=PER_ITEM,
            key="item",
            rows_per_unit=len(self.opts.configurations())
            * (len(self.opts.settings) if self.opts.task == "ruler" else 1),
        )

    def _item(self, i: int) -> list[dict[str, Any]]:
        item = self.items[i]
        rows = item_rows(self.model, item, self.opts)
        task = item.task if isinstance(item, RulerItem) else self.opts.task
        return [{"item": i, "task": task, **r} for r in rows]

    def result(
        self, rows: Mapping[str, list[dict[str, str]]], run_info: dict[str, Any]
    ) -> KVEvalResult:
        config = {
            **self._config,
            "items_available": len(self.items),
            "seconds": run_info["seconds"],
        }
        return KVEvalResult.from_rows(rows, config, run_info)


def kv_eval(
    model: LoadedModel,
    texts: Sequence[str] | None = None,
    *,
    options: KVEvalOptions | None = None,
    out: str | Path | None = None,
    resume: bool = False,
    source: str | None = None,
    progress: bool = True,
) -> KVEvalResult:
    """Evaluate KV-cache compression methods (see the module docstring and ``cw kv-eval``).

    ``texts`` (for the ``lm`` task) are running texts; consecutive ones are joined until
    an item has ``context_tokens + 129`` tokens. The ``passkey`` task needs no texts; the
    ``ruler`` task's needle tasks take their haystack from them (FineWeb-Edu).
    Resumable in ``out`` and data parallel under ``accelerate launch``, like every
    experiment of the runner.
    """
    opts = options or KVEvalOptions()
    if opts.task == "lm" and not texts:
        raise ValueError("the lm task needs texts: pass --dataset or --texts")
    if opts.task == "ruler" and not texts and set(opts.ruler_tasks) - {"cwe", "fwe"}:
        raise ValueError(
            "the ruler tasks take their haystack from texts: pass FineWeb-Edu texts "
            "(cw.data.load_texts('fineweb-edu'); the CLI reads them from --data-dir)"
        )
    experiment = KVEval(model, texts, opts, source)
    se = "nll_se, delta_se" if opts.task == "lm" else "accuracy_se"
    warn_few_samples(len(experiment.items), "item", se)
    return run_experiment(experiment, out, resume=resume, progress=progress)
