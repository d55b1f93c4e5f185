"""``attribution-eval``: end-to-end attributions checked against known answers and by
deletion and insertion (docs/attribution.md).

Per item (a generated known-answer item, or a natural text for ``deletion``), every method
attributes the log-probability of the item's answer at its last position. Then:

* **Known answer** (induction, lookup, passkey): the rank of the source token among the
  candidate positions (those of the curves: every position but the target's own, and
  token 0 under sink protection), whether it is first (top-1) or among the first five
  (top-5), and its rank among all positions but the target's (``rank_all``).
* **Deletion and insertion**: the candidates (every position but the target's own, and
  token 0 under sink protection) are ranked by each method's scores and by the baselines
  (random seeds, recency); at each rate p the top ⌈p·N⌉ are removed (comprehensiveness:
  a faithful ranking makes the log-probability drop most), the bottom ones are removed
  (sufficiency: it should drop least), or only the top ones are kept (insertion: it should
  drop least). ``delta`` = log P(answer | full) − log P(answer | edited). A removed token
  leaves every head's softmax in every layer (``key_mask``: an attention mask, so the
  other weights renormalise; positions are unchanged), or its input embedding is replaced
  by the vocabulary's mean embedding (``embedding``).

Rows go to ``rows.csv`` (kind ``hit`` per method, kind ``curve`` per ranking,
intervention, mode and rate); on known-answer tasks the baselines' hits (the same ranks,
by the random and recency orders the curves use) go to ``baseline_hits.csv`` in a second
phase, which needs no forward pass: ``--resume`` on a run made before it existed adds them
in seconds. A method added to a run later (``--add-methods`` with ``--resume``: the run
need not be rerun for a new method, and the new one is paired with the old ones on the
same items) has a phase of its own, its hit and curve rows in ``added-{method}.csv``. The
summary and the paired statistics are computed from them all: flow, and ``direct`` where
it is one of the run's methods, against the run's other rankings, and each added method
against every ranking, one Holm family each (:meth:`AttributionEvalResult.families`);
bootstrap intervals for the curves, McNemar on top-1 hits.

Layout:

* :mod:`.options` — :class:`AttributionEvalOptions` (pure Python: ``cw attribution-eval
  --help`` imports nothing heavy);
* :mod:`.run` — the rankings (:func:`ranking_order`) and removal sets
  (:func:`removal_sets`), the :class:`Editor`, the :class:`AttributionEval` experiment's
  units and phases, and :func:`attribution_eval`;
* :mod:`.tables` — the rows' columns and :class:`AttributionEvalResult`: the hit and curve
  tables, the summary, the paired statistics and ``tables.md``.

Only :mod:`.options` is imported with the package; the other names are imported on first
use (PEP 562), so that the experiment's registration (:mod:`..spec`) stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...lazy import lazy_exports
from .options import AttributionEvalOptions

if TYPE_CHECKING:  # what the names below resolve to, for type checkers and IDEs
    from .run import AttributionEval, Editor, attribution_eval, ranking_order, removal_sets
    from .tables import (
        COLUMNS,
        MODES,
        NUMBERS,
        REFERENCE,
        REFERENCES,
        VERDICTS,
        AttributionEvalResult,
        added_file,
    )

#: where each name lives (imported when first used)
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(
        ("AttributionEval", "Editor", "attribution_eval", "ranking_order", "removal_sets"),
        ".run",
    ),
    **dict.fromkeys(
        ("COLUMNS", "MODES", "NUMBERS", "REFERENCE", "REFERENCES", "VERDICTS",
         "AttributionEvalResult", "added_file"),
        ".tables",
    ),
}  # fmt: skip

__all__ = [
    "COLUMNS",
    "MODES",
    "NUMBERS",
    "REFERENCE",
    "REFERENCES",
    "VERDICTS",
    "AttributionEval",
    "AttributionEvalOptions",
    "AttributionEvalResult",
    "Editor",
    "added_file",
    "attribution_eval",
    "ranking_order",
    "removal_sets",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
