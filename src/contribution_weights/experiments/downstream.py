"""Faithfulness on downstream tasks (method §4, paper Figure 4).

Each :class:`~..data.ChoiceItem` is scored by the log-likelihood of each option after
the prompt: the option with the highest summed log-probability of its tokens is the
model's answer. Under sufficiency removal at rate p, the bottom ⌈p·N⌉ eligible *prompt*
tokens are removed per (layer, head) (token scores average over the prompt's queries
only, so the removal is the same whatever option follows). All (configuration, option)
rows of one item run as one batched forward, options right-padded (padding comes after
every scored token, so causal attention never sees it).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..data import ChoiceItem
from ..interventions import CLEAN, SINK_COSINE, Removal
from ..loading import LoadedModel
from ..measures.registry import resolve_measures
from ..runs import RunFolder, fingerprint
from .faithfulness import DEFAULT_MEASURES, DEFAULT_RATES, as_floats
from .removal import DEFAULT_MEMORY_BYTES, token_logprobs

PER_ITEM = "per_item.csv"
SUMMARY = "summary.csv"
SUMMARY_COLUMNS = ["task", "measure", "rate", "n", "accuracy", "clean_accuracy"]


def encode_item(model: LoadedModel, item: ChoiceItem) -> tuple[list[int], list[list[int]]]:
    """Prompt ids (with the tokenizer's special tokens) and each option's ids (without)."""
    prompt = list(model.tokenizer(item.prompt, add_special_tokens=True)["input_ids"])
    options = [
        list(model.tokenizer(o, add_special_tokens=False)["input_ids"]) for o in item.options
    ]
    if not prompt or any(not o for o in options):
        raise ValueError(f"empty prompt or option after tokenisation: {item!r}")
    return prompt, options


def option_scores(
    model: LoadedModel,
    prompt: Sequence[int],
    options: Sequence[Sequence[int]],
    removals: Sequence[Removal],
    *,
    protect_sinks: bool = True,
    sink_threshold: float = SINK_COSINE,
    batch_size: int | None = None,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
) -> torch.Tensor:
    """``(len(removals), len(options))`` summed log-probability of each option's tokens."""
    p = len(prompt)
    width = p + max(len(o) for o in options)
    rows = len(removals) * len(options)
    pad = int(prompt[0])
    ids = torch.full((rows, width), pad, dtype=torch.long)
    row_removals = []
    for r, (removal, option) in enumerate(itertools.product(removals, options)):
        seq = [*prompt, *option]
        ids[r, : len(seq)] = torch.tensor(seq)
        row_removals.append(removal)
    logp = token_logprobs(
        model,
        ids,
        row_removals,
        eligible_len=p,
        protect_sinks=protect_sinks,
        sink_threshold=sink_threshold,
        batch_size=batch_size,
        memory_bytes=memory_bytes,
    )
    scores = torch.empty(rows, dtype=torch.float64)
    for r, (_, option) in enumerate(itertools.product(removals, options)):
        # log p of option token k sits at position p - 1 + k of the shifted targets
        scores[r] = logp[r, p - 1 : p - 1 + len(option)].double().sum()
    return scores.reshape(len(removals), len(options))


def pick(scores: torch.Tensor) -> torch.Tensor:
    """Index of the best option per row (first one on ties)."""
    return scores.argmax(dim=-1)


def summarise(per_item: pd.DataFrame, task: str) -> pd.DataFrame:
    if per_item.empty:
        return pd.DataFrame(columns=SUMMARY_COLUMNS)
    rows = []
    clean = per_item.drop_duplicates("item")["clean_correct"].astype(float).mean()
    for (measure, rate), g in per_item.groupby(["measure", "rate"], sort=False):
        acc = g["correct"].astype(float).mean()
        rows.append([task, measure, float(rate), len(g), acc, clean])
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


@dataclass
class DownstreamResult:
    per_item: pd.DataFrame
    summary: pd.DataFrame
    config: dict[str, Any]

    def plot(self, path: str | Path | None = None) -> Any:
        from ..presentation.faithfulness_plots import plot_downstream

        return plot_downstream(self.summary, path=path)


def downstream(
    model: LoadedModel,
    items: Sequence[ChoiceItem],
    task: str = "task",
    measures: Sequence[str] = DEFAULT_MEASURES,
    rates: Sequence[float] = DEFAULT_RATES,
    protect_sinks: bool = True,
    max_tokens: int = 512,
    out: str | Path | None = None,
    resume: bool = False,
    batch_size: int | None = None,
    *,
    sink_threshold: float = SINK_COSINE,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    progress: bool = True,
) -> DownstreamResult:
    """Accuracy under sufficiency removal over the prompt tokens, per measure and rate.

    Items whose prompt plus longest option exceed ``max_tokens`` are skipped (counted in
    ``config["skipped"]``).
    """
    if not items:
        raise ValueError("no items given; load some with cw.data.load_task(task, n)")
    if max_tokens < 2:
        raise ValueError(
            f"max_tokens must be at least 2 (a prompt token and an option token), got {max_tokens}"
        )
    names = resolve_measures(measures)  # a string is a name or "a,b", not letters
    rate_list = sorted({float(r) for r in as_floats(rates)})
    removals = [Removal(m, "sufficiency", r) for m in names for r in rate_list]
    config = {
        "experiment": "downstream",
        "task": task,
        "model": model.name,
        "measures": names,
        "rates": rate_list,
        "protect_sinks": protect_sinks,
        "sink_threshold": sink_threshold,
        "max_tokens": max_tokens,
        "n_items": len(items),
        # resuming with other items (prompt, options or answer) is refused
        "items_sha256": fingerprint([item.prompt, item.options, item.answer] for item in items),
    }
    folder = RunFolder(out, config, resume=resume) if out is not None else None
    records: list[dict[str, Any]] = []
    done: set[int] = set()
    if folder is not None:  # an item is done only when all its rows were written
        kept, keys = folder.complete_rows(PER_ITEM, "item", len(removals))
        records, done = list(kept), {int(k) for k in keys}
    skipped = 0
    started = time.perf_counter()
    bar = tqdm(total=len(items), initial=len(done), desc=f"downstream {task}", unit="item",
               disable=not progress)  # fmt: skip
    try:
        for i, item in enumerate(items):
            if i in done:
                continue
            prompt, options = encode_item(model, item)
            if len(prompt) + max(len(o) for o in options) > max_tokens:
                skipped += 1
                bar.update(1)
                continue
            scores = option_scores(
                model, prompt, options, [CLEAN, *removals], protect_sinks=protect_sinks,
                sink_threshold=sink_threshold, batch_size=batch_size, memory_bytes=memory_bytes,
            )  # fmt: skip
            picks = pick(scores).tolist()
            clean_ok = int(picks[0] == item.answer)
            rows = [
                {
                    "item": i,
                    "measure": r.measure,
                    "rate": r.rate,
                    "answer": item.answer,
                    "pick": pk,
                    "correct": int(pk == item.answer),
                    "clean_pick": picks[0],
                    "clean_correct": clean_ok,
                    "n_prompt_tokens": len(prompt),
                }
                for r, pk in zip(removals, picks[1:], strict=True)
            ]
            if folder is not None:
                folder.append_rows(PER_ITEM, rows)
            records.extend(rows)
            bar.update(1)
    finally:
        bar.close()
    frame = pd.DataFrame(records)
    if not frame.empty:
        for col in ("item", "answer", "pick", "correct", "clean_pick", "clean_correct"):
            frame[col] = frame[col].astype(int)
        frame["rate"] = frame["rate"].astype(float)
        frame = frame.sort_values(["item"], kind="stable").reset_index(drop=True)
    config["skipped"] = skipped
    config["seconds"] = round(time.perf_counter() - started, 1)
    result = DownstreamResult(frame, summarise(frame, task), config)
    if folder is not None:
        result.summary.to_csv(folder.file(SUMMARY), index=False)
        folder.write_json("run_info.json", {"skipped": skipped, "seconds": config["seconds"]})
    return result
