"""``cw kv-eval``: KV-cache compression methods against ratio, on LM, passkey and RULER-like
long-context tasks.

Per item, one scored prefill (:func:`~contribution_weights.kv.prefill`) serves every
method and ratio; each (method, ratio) is a copy of the cache compressed and evaluated by
the task (:mod:`contribution_weights.kv.evaluate`). Ratio 0 (no compression) is evaluated
once per item, under the method name ``none``. An item is one unit of the experiment
runner (:mod:`..runner`): its rows are appended to ``per_item.csv`` as it finishes, so an
interrupted run resumes where it stopped, ``run_info.json`` (versions, ``finished``,
``seconds`` added up over resumed sessions) is written when a session ends, and under
``accelerate launch`` the items are dealt over the processes.

The ``ruler`` task (:mod:`contribution_weights.kv.ruler`) makes ``n`` items of each of
``ruler_tasks``; an item is prefilled once per setting (``query_agnostic``: the context;
``query_aware``: the context and the question) and yields a row per (setting, method,
ratio), its ``task`` the RULER-like task's name. Its summary adds, to every row, the
accuracy of the same task and setting uncompressed (``uncompressed_accuracy``).

Layout:

* :mod:`.options`: :class:`KVEvalOptions` (light: ``cw kv-eval --help`` needs no torch),
  the tasks, their metrics, and ``none``, the name of the uncompressed configuration;
* :mod:`.run`: the :class:`KVEval` experiment (an item's prefill, compressions and rows,
  what each compression cost) and the entry point :func:`kv_eval`;
* :mod:`.result`: :class:`KVEvalResult` (rows, tables, join, versus, the files a run
  writes) and :func:`shortfall`, the lines said after the summary;
* :mod:`.tables`: the summaries and tests from the per-item rows;
* :mod:`.markdown`: ``tables.md``.

The options' names are imported here; the others (their modules import torch or pandas)
when first used, so that importing :mod:`.options` (as ``experiments/options.py`` and
``experiments/spec.py`` do) stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...lazy import lazy_exports
from .options import (
    DEFAULT_RATIOS,
    METRIC,
    NO_COMPRESSION,
    TASKS,
    KVEvalOptions,
    check_ruler_tasks,
    check_settings,
)

if TYPE_CHECKING:
    from .markdown import tables_markdown
    from .result import (
        CANNOT_DO,
        PER_ITEM,
        SUMMARY,
        SUMMARY_DEPTH,
        SUMMARY_PAIRED,
        SUMMARY_PAIRS,
        SUMMARY_RANKING,
        SUMMARY_SETTINGS,
        SUMMARY_VERSUS,
        KVEvalResult,
        cannot_do,
        shortfall,
    )
    from .run import GENERATE_BATCH, KVEval, cost, first_token_kept, item_rows, kv_eval, ruler_rows
    from .tables import (
        BETTER,
        COST_COLUMNS,
        HIGHER_IS_BETTER,
        PAIRS_COLUMNS,
        RANKING_COLUMNS,
        SETTINGS_COLUMNS,
        TEST,
        VERSUS_COLUMNS,
        WORSE,
        method_pairs,
        method_ranking,
        paired_summary,
        ruler_summary,
        setting_pairs,
        summarise,
        uncompressed_pairs,
    )

#: the module of each name imported on first use
_LAZY = {
    "tables_markdown": ".markdown",
    "CANNOT_DO": ".result",
    "PER_ITEM": ".result",
    "SUMMARY": ".result",
    "SUMMARY_DEPTH": ".result",
    "SUMMARY_PAIRED": ".result",
    "SUMMARY_PAIRS": ".result",
    "SUMMARY_RANKING": ".result",
    "SUMMARY_SETTINGS": ".result",
    "SUMMARY_VERSUS": ".result",
    "KVEvalResult": ".result",
    "cannot_do": ".result",
    "shortfall": ".result",
    "GENERATE_BATCH": ".run",
    "KVEval": ".run",
    "cost": ".run",
    "first_token_kept": ".run",
    "item_rows": ".run",
    "kv_eval": ".run",
    "ruler_rows": ".run",
    "BETTER": ".tables",
    "COST_COLUMNS": ".tables",
    "HIGHER_IS_BETTER": ".tables",
    "PAIRS_COLUMNS": ".tables",
    "RANKING_COLUMNS": ".tables",
    "SETTINGS_COLUMNS": ".tables",
    "TEST": ".tables",
    "VERSUS_COLUMNS": ".tables",
    "WORSE": ".tables",
    "method_pairs": ".tables",
    "method_ranking": ".tables",
    "paired_summary": ".tables",
    "ruler_summary": ".tables",
    "setting_pairs": ".tables",
    "summarise": ".tables",
    "uncompressed_pairs": ".tables",
}

__all__ = [
    "BETTER",
    "CANNOT_DO",
    "COST_COLUMNS",
    "DEFAULT_RATIOS",
    "GENERATE_BATCH",
    "HIGHER_IS_BETTER",
    "METRIC",
    "NO_COMPRESSION",
    "PAIRS_COLUMNS",
    "PER_ITEM",
    "RANKING_COLUMNS",
    "SETTINGS_COLUMNS",
    "SUMMARY",
    "SUMMARY_DEPTH",
    "SUMMARY_PAIRED",
    "SUMMARY_PAIRS",
    "SUMMARY_RANKING",
    "SUMMARY_SETTINGS",
    "SUMMARY_VERSUS",
    "TASKS",
    "TEST",
    "VERSUS_COLUMNS",
    "WORSE",
    "KVEval",
    "KVEvalOptions",
    "KVEvalResult",
    "cannot_do",
    "check_ruler_tasks",
    "check_settings",
    "cost",
    "first_token_kept",
    "item_rows",
    "kv_eval",
    "method_pairs",
    "method_ranking",
    "paired_summary",
    "ruler_rows",
    "ruler_summary",
    "setting_pairs",
    "shortfall",
    "summarise",
    "tables_markdown",
    "uncompressed_pairs",
]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
