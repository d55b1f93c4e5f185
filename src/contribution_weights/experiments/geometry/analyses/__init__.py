"""The built-in geometry analyses, one module each; importing this package registers them.

Each module holds one analysis whole: the statistic only it needs, its
:class:`~..analysis.Analysis` subclass (build, ``tables.json`` entries, ``tables.md``
section) and its registration. Its figure is registered in the presentation layer under
the same name. Registration order (:data:`BUILT_IN`) is the order of ``tables.json``,
``tables.md``, ``per_layer.csv`` and the figures.
"""

from __future__ import annotations

import importlib

from ..analysis import analysis_names, get_analysis

#: the modules of the built-in analyses, imported (so registered) in this order
BUILT_IN = (
    "regression",
    "correlations",
    "first_token_weight",
    "entropy",
    "sink_alignment",
    "sink_scaling",
    "norm_fit",
    "semantic_cone",
    "joint_distributions",
)
for _module in BUILT_IN:
    importlib.import_module(f".{_module}", __name__)

#: the built-in analyses, in their order in tables.json, tables.md and the figures
ANALYSES = tuple(analysis_names())

#: the keys of tables.json, present (None when not run) whatever ran
JSON_KEYS = tuple(key for name in ANALYSES for key in get_analysis(name).json_entries())
