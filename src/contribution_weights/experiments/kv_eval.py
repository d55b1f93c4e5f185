"""``cw kv-eval``: KV-cache compression methods against ratio, on LM and passkey tasks.

Per item, one scored prefill (:func:`~contribution_weights.kv.prefill`) serves every
method and ratio; each (method, ratio) is a copy of the cache compressed and evaluated by
the task (:mod:`contribution_weights.kv.evaluate`). Ratio 0 (no compression) is evaluated
once per item, under the method name ``none``. An item is one unit of the experiment
runner (:mod:`.runner`): its rows are appended to ``per_item.csv`` as it finishes, so an
interrupted run resumes where it stopped, ``run_info.json`` (versions, ``finished``,
``seconds`` added up over resumed sessions) is written when a session ends, and under
``accelerate launch`` the items are dealt over the processes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from ..defaults import KV_RATIOS, KV_TASKS  # light: the CLI shows them before torch
from ..kv import compress, prefill
from ..kv.evaluate import lm_item, lm_items, lm_score, passkey_items, passkey_score
from ..loading import LoadedModel
from ..runs import fingerprint
from .options import KVEvalOptions
from .result import SUMMARY as SUMMARY  # re-exported: the summary file
from .result import RowsResult, warn_few_samples, write_csv
from .runner import Experiment, Phase, run_experiment

TASKS = KV_TASKS
METRIC = {"lm": "nll", "passkey": "accuracy"}
DEFAULT_RATIOS = KV_RATIOS
PER_ITEM = "per_item.csv"
SUMMARY_DEPTH = "summary_depth.csv"
SUMMARY_PAIRED = "summary_paired.csv"
NO_COMPRESSION = "none"


class KVEvalResult(RowsResult):
    """Per-item rows, their summaries, the run's configuration and run_info."""

    ROWS = PER_ITEM

    @property
    def per_item(self) -> pd.DataFrame:
        """One row per (item, method, ratio): the task's metric and the kept first token."""
        return self.rows

    def summarise_rows(self) -> pd.DataFrame:
        return summarise(self.rows, self.config["task"])

    @classmethod
    def frame(cls, rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
        return _typed(pd.DataFrame(list(rows)))

    def by_depth(self) -> pd.DataFrame:
        """Passkey accuracy per (method, ratio, depth)."""
        return summarise(self.per_item, self.config["task"], by=("depth",))

    def paired(self) -> pd.DataFrame:
        """Each item's metric minus its own uncompressed one, mean and standard error per
        (method, ratio): ``method, task, ratio, n, delta_mean, delta_se``. Differences on
        the same item and continuation separate methods far better than the raw means,
        whose spread is mostly how hard each text is."""
        return paired_summary(self.per_item, self.config["task"])

    def write_summary(self, folder: Path) -> None:
        """``summary.csv``, ``summary_paired.csv`` (and ``summary_depth.csv`` for passkey);
        the runner's hook at the end of a run."""
        super().write_summary(folder)
        write_csv(Path(folder) / SUMMARY_PAIRED, self.paired())
        if self.config["task"] == "passkey":
            write_csv(Path(folder) / SUMMARY_DEPTH, self.by_depth())

    @classmethod
    def from_files(
        cls, folder: Path, config: dict[str, Any], run_info: dict[str, Any]
    ) -> KVEvalResult:
        """The complete items written so far (a finished or an interrupted run)."""
        per_item = pd.read_csv(folder / PER_ITEM)
        rows_per_item = per_item.groupby("item").size()
        complete = rows_per_item[rows_per_item == rows_per_item.max()].index
        rows = per_item[per_item["item"].isin(complete)].reset_index(drop=True)
        return cls(rows, config, run_info)


def summarise(per_item: pd.DataFrame, task: str, by: Sequence[str] = ()) -> pd.DataFrame:
    """Mean and standard error over items per (method, ratio[, by…])."""
    metric = METRIC[task]
    cols = ["method", "task", "ratio", *by, "n", f"{metric}_mean", f"{metric}_se"]
    if per_item.empty:
        return pd.DataFrame(columns=cols)
    g = per_item.groupby(["method", "ratio", *by], sort=False)
    out = g.agg(
        n=(metric, "size"), **{f"{metric}_mean": (metric, "mean"), f"{metric}_se": (metric, "sem")}
    ).reset_index()
    out["task"] = task
    return out.sort_values(["ratio", "method", *by], kind="stable")[cols].reset_index(drop=True)


def paired_summary(per_item: pd.DataFrame, task: str) -> pd.DataFrame:
    """Per (method, ratio): mean and s.e. over items of the metric minus the same item's
    uncompressed metric (items without an uncompressed row are left out)."""
    metric = METRIC[task]
    cols = ["method", "task", "ratio", "n", "delta_mean", "delta_se"]
    if per_item.empty or NO_COMPRESSION not in set(per_item["method"]):
        return pd.DataFrame(columns=cols)
    base = per_item[per_item["method"] == NO_COMPRESSION].set_index("item")[metric]
    delta = per_item[metric].astype(float) - per_item["item"].map(base).astype(float)
    frame = per_item.assign(delta=delta).dropna(subset=["delta"])
    g = frame.groupby(["method", "ratio"], sort=False)["delta"]
    out = g.agg(n="size", delta_mean="mean", delta_se="sem").reset_index()
    out["delta_se"] = out["delta_se"].fillna(0.0)
    out["task"] = task
    return out.sort_values(["ratio", "method"], kind="stable")[cols].reset_index(drop=True)


def _items(model: LoadedModel, opts: KVEvalOptions, texts: Sequence[str] | None) -> Iterator[Any]:
    if opts.task == "passkey":
        yield from passkey_items(model, opts.context_tokens, opts.n, opts.seed)
    else:
        assert texts is not None
        for ids in lm_items(model, texts, opts.context_tokens, opts.n):
            yield lm_item(ids, opts.context_tokens)


def first_token_kept(kept: dict[int, torch.Tensor]) -> float:
    """Fraction of (layer, KV head) kept sets that hold position 0 (the usual sink)."""
    flags = [(k == 0).any(-1).float().mean() for k in kept.values()]
    return round(float(torch.stack(flags).mean()), 4) if flags else 1.0


def item_rows(model: LoadedModel, item: Any, opts: KVEvalOptions) -> list[dict[str, Any]]:
    """One row per (method, ratio) configuration of one item."""
    context = item.context if opts.task == "passkey" else item[0]
    started = time.perf_counter()
    pre = prefill(model, context, opts.window, seed=opts.seed, methods=opts.methods)
    prefill_s = time.perf_counter() - started
    rows = []
    for method, ratio in opts.configurations():
        small = compress(pre, "h2o" if method == NO_COMPRESSION else method, ratio)
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
            }
        )
    return rows


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
            rows_per_unit=len(self.opts.configurations()),
        )

    def _item(self, i: int) -> list[dict[str, Any]]:
        rows = item_rows(self.model, self.items[i], self.opts)
        return [{"item": i, "task": self.opts.task, **r} for r in rows]

    def result(
        self, rows: Mapping[str, list[dict[str, str]]], run_info: dict[str, Any]
    ) -> KVEvalResult:
        config = {
            **self._config,
            "items_available": len(self.items),
            "seconds": run_info["seconds"],
        }
        return KVEvalResult.from_rows(rows, config, run_info)


def _typed(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows as read back from the CSV (strings) with numeric columns as numbers, in item
    order; the same types :meth:`KVEvalResult.load` gets from ``pd.read_csv``."""
    for col in frame.columns:
        with contextlib.suppress(ValueError, TypeError):
            frame[col] = pd.to_numeric(frame[col])
    if frame.empty:
        return frame
    frame["ratio"] = frame["ratio"].astype(float)
    return frame.sort_values(["item"], kind="stable").reset_index(drop=True)


def shortfall(result: KVEvalResult) -> list[str]:
    """A line saying the texts ran out, when a language-modelling run got fewer items than
    asked for (each item needs ``context_tokens + 129`` tokens of consecutive texts)."""
    c = result.config
    done = int(result.summary["n"].max()) if not result.summary.empty else 0
    if c["task"] != "lm" or done >= int(c["n"]):
        return []
    need = int(c["context_tokens"]) + 129
    return [f"only {done} of {c['n']} items: the texts ran out (each needs {need} tokens)"]


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
    an item has ``context_tokens + 129`` tokens. The ``passkey`` task needs no texts.
    Resumable in ``out`` and data parallel under ``accelerate launch``, like every
    experiment of the runner.
    """
    opts = options or KVEvalOptions()
    if opts.task == "lm" and not texts:
        raise ValueError("the lm task needs texts: pass --dataset or --texts")
    experiment = KVEval(model, texts, opts, source)
    se = "accuracy_se" if opts.task == "passkey" else "nll_se, delta_se"
    warn_few_samples(len(experiment.items), "item", se)
    return run_experiment(experiment, out, resume=resume, progress=progress)
