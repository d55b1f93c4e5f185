"""Interactive HTML report of a :class:`~contribution_weights.tracing.result.Trace`.

:func:`write_report` writes ONE self-contained HTML file: the page's script, styles and
data are inline, so it opens offline in any current browser and can be shared as is.
In the page, hovering or clicking a token colours every earlier token by its weight for
the chosen measure, layer and head (or the sum over heads, or the mean over layers); two
heatmaps compare attention and contribution; a chart shows the first-token weight per
layer, and a table the trace's summary.

Lifetime of the data: the trace's float32 tensors are quantised here into compressed
*chunks* (see :mod:`.report_data`: lower triangle only, 8-bit per row or float16), one
per (measure, embedded layer) plus one per measure for the mean over all traced layers.
The page inflates a chunk the first time it is shown and keeps a few dozen in memory.
When the file would exceed ``max_bytes``, evenly spaced layers are kept (first and last
included), a :class:`ReportSizeWarning` is issued and the page shows the same warning.

In Jupyter a trace displays through :func:`notebook_html`: the same page in compact
form, in an ``<iframe srcdoc>`` so its script and styles cannot clash with the notebook.
"""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

import numpy as np

from ..measures.registry import get_measure
from ..progress import status
from .page import CHUNK_TAG, REPORT_CSP, asset, fill, json_for_script, styles
from .report_data import (  # DEFAULT_*: light, for `cw report --help` before torch
    DEFAULT_MAX_BYTES,
    DEFAULT_MEASURES,
    ChunkInfo,
    check_precision,
    decode_chunk,
    page_data,
    rounding_note,
)
from .report_encoder import FullEncoder, declared_signed, measure_meta
from .report_fit import ReportInfo, ReportSizeWarning, dropped_note, finish_page

if TYPE_CHECKING:
    from ..tracing.result import Trace

__all__ = [
    "LONG_TEXT_TOKENS",
    "NOTEBOOK_MAX_BYTES",
    "NO_MAPS_MESSAGE",
    "VIEWS",
    "EmbeddedReport",
    "ReportInfo",
    "ReportOptions",
    "ReportSizeWarning",
    "build_report",
    "notebook_html",
    "read_report",
    "resolve_view",
    "traced_measures",
    "view_defaults",
    "write_report",
]

VIEWS = ("auto", "full", "long")

NOTEBOOK_MAX_BYTES = 8 * 2**20
FORMAT_VERSION = 1
#: from this many tokens the page opens with √ contrast and each heatmap row scaled to its
#: own maximum: at a few hundred tokens most weights are small next to the sink and the
#: diagonal, and a linear scale for the whole block leaves the heatmaps nearly blank
LONG_TEXT_TOKENS = 200
#: why a trace without maps has no report, and what to run instead (Python spelling;
#: ``cw report`` says the same with the CLI's)
NO_MAPS_MESSAGE = (
    "this trace holds no maps, only per-(layer, head) reductions (token scores, first-token "
    "weight, entropy, top-k keys): it was traced with maps=False, and the full view shows "
    'T × T maps. Write the long view (view="long" or "auto"), which shows the reductions '
    "over the text, or trace the text again with maps, e.g. cw.trace(model, text, "
    'measures=["attention", "contribution"], out=DIR, storage_dtype="float16") for a long '
    "text (maps streamed to disk, in half the space), and write that trace's report"
)


def traced_measures() -> list[str]:
    """What ``cw report`` traces a text with when no measures are named: the default
    measures but those computed only when named (``distance``, T²·d per head and layer:
    a minute for 200 tokens of SmolLM2 on a CPU)."""
    return [m for m in DEFAULT_MEASURES if get_measure(m).in_all]


def view_defaults(num_tokens: int) -> dict[str, str]:
    """The page's initial contrast and heatmap scaling (the reader can change both)."""
    long = num_tokens >= LONG_TEXT_TOKENS
    return {"contrast": "sqrt" if long else "linear", "heat_rows": "row" if long else "block"}


def _resolve_measures(
    trace: Trace, measures: str | list[str] | tuple[str, ...] | None
) -> list[str]:
    if measures is None:
        names = [m for m in DEFAULT_MEASURES if m in trace.measures]
        if not names:
            raise ValueError(
                "the trace has none of the report's default measures "
                f"({', '.join(DEFAULT_MEASURES)}); it has {', '.join(trace.measures)}: "
                "pass measures=[...] to choose from those"
            )
        return names
    if measures == "all":
        return list(trace.measures)
    if isinstance(measures, str):
        measures = [m.strip() for m in measures.split(",") if m.strip()]
    names = []
    for name in measures:
        if name not in trace.measures:
            raise ValueError(
                f"measure {name!r} is not in this trace (it has {', '.join(trace.measures)}); "
                "trace it first or leave it out of the report"
            )
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError("no measure given for the report")
    return names


def _finite(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


def _summary_tables(trace: Trace) -> tuple[dict[str, Any], dict[str, Any]]:
    if not trace.weight_measures():
        return {"columns": [], "rows": []}, {"layers": trace.layers, "series": {}}
    summary = trace.summary()
    table = {
        "columns": list(summary.columns),
        "rows": [
            {"measure": str(idx), **{c: _finite(v) for c, v in row.items()}}
            for idx, row in summary.iterrows()
        ],
    }
    by_layer = trace.first_token_weight_by_layer()
    chart = {
        "layers": [int(x) for x in by_layer.index],
        "series": {c: [_finite(v) for v in by_layer[c]] for c in by_layer.columns},
    }
    return table, chart


def _render(
    meta: dict[str, Any], chunks: list[tuple[ChunkInfo, str]], title: str, compact: bool
) -> str:
    meta = {**meta, "chunks": {f"{c.measure}/{c.layer}": c.script_id for c, _ in chunks}}
    parts = {
        "__CW_CSP__": REPORT_CSP,
        "__CW_TITLE__": html.escape(title),
        "__CW_BODY_CLASS__": "compact" if compact else "full",
        "/*__CW_CSS__*/": styles("report.css"),
        "//__CW_JS__": "\n".join(
            asset(n) for n in ("report_data.js", "report_chart.js", "report.js")
        ),
        "__CW_META__": json_for_script(meta),
        "<!--__CW_CHUNKS__-->": "".join(
            CHUNK_TAG.format(id=c.script_id, data=text) for c, text in chunks
        ),
    }
    return fill("report.html", parts)


def build_report(
    trace: Trace,
    *,
    measures: str | list[str] | tuple[str, ...] | None = None,
    layers: list[int] | None = None,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
    precision: str = "uint8",
    compact: bool = False,
    title: str | None = None,
    progress: bool = True,
    view: str = "auto",
    window: tuple[int, int] | None = None,
) -> tuple[str, ReportInfo]:
    """The report's HTML text and what it holds (see :func:`write_report`)."""
    check_precision(precision)
    view = resolve_view(trace, view)
    if view == "full" and not trace.has_maps:
        raise ValueError(NO_MAPS_MESSAGE)
    names = _resolve_measures(trace, measures)
    if view == "long" and measures is None:  # a page linear in T: the two measures asked for
        names = [m for m in ("attention", "contribution") if m in names] or names
    wanted = list(trace.layers) if layers is None else sorted({int(x) for x in layers})
    for layer in wanted:
        trace.layer_position(layer)  # raises with the traced layers listed
    if not wanted:
        raise ValueError("no layer given for the report; pass layers=None for all traced layers")
    if view == "long":
        return _build_long(trace, names, wanted, max_bytes, title, progress, window)
    with status("report: summary (first-token weight, entropy)", enabled=progress):
        table, chart = _summary_tables(trace)
    enc = FullEncoder(trace, names, precision, progress, len(wanted))
    title = title or f"Contribution weights · {trace.model_name or 'trace'}"
    meta: dict[str, Any] = {
        "version": FORMAT_VERSION,
        "title": title,
        "model": trace.model_name,
        "model_type": trace.meta.get("model_type", ""),
        "tokens": list(trace.tokens),
        "ids": [int(i) for i in trace.input_ids.tolist()],
        "num_tokens": trace.num_tokens,
        "num_heads": trace.num_heads,
        "traced_layers": list(trace.layers),
        "num_model_layers": trace.meta.get("num_layers", len(trace.layers)),
        "measure_order": names,
        "measures": {n: measure_meta(n, enc.signed[n]) for n in names},
        "precision": precision,
        "rounding": rounding_note(precision, [n for n in names if enc.signed[n]]),
        "summary": table,
        "first_token_weight": chart,
        "degenerate": {
            str(layer): np.flatnonzero(trace.degenerate[i].numpy()).tolist()
            for i, layer in enumerate(trace.layers)
        },
        "compact": compact,
        "defaults": view_defaults(trace.num_tokens),
    }

    def render(chosen: list[int], notes: list[str]) -> str:
        chunks = list(enc.mean_chunks)
        for k in range(len(names)):
            chunks += [enc.layer(layer)[k] for layer in chosen]
        return _render({**meta, "layers": chosen, "warnings": notes}, chunks, title, compact)

    mean_note = f"'Mean over layers' still averages all {len(trace.layers)} traced layers. "

    def notes_for(chosen: list[int]) -> list[str]:
        return dropped_note(wanted, chosen, max_bytes, mean_note)

    def page_for(chosen: list[int]) -> str:
        return render(chosen, notes_for(chosen))

    return finish_page(enc, wanted, max_bytes, page_for, notes_for, names, precision, "full")


def resolve_view(trace: Trace, view: str) -> str:
    """``"full"`` (every T × T map) or ``"long"`` (:mod:`.long_report`); ``"auto"``: full
    up to :data:`~.long_report.LONG_VIEW_TOKENS` tokens, long beyond and for a trace
    without maps."""
    from .long_report import LONG_VIEW_TOKENS

    if view not in VIEWS:
        raise ValueError(f"unknown view {view!r}; use one of {', '.join(VIEWS)}")
    if view == "auto":
        return "long" if trace.num_tokens > LONG_VIEW_TOKENS or not trace.has_maps else "full"
    return view


def _build_long(
    trace: Trace,
    names: list[str],
    wanted: list[int],
    max_bytes: int | None,
    title: str | None,
    progress: bool,
    window: tuple[int, int] | None,
) -> tuple[str, ReportInfo]:
    """The long view's page (:mod:`.long_report`), layers chosen to fit ``max_bytes``
    (default :data:`~.long_report.LONG_MAX_BYTES`) as the full view chooses them."""
    from .long_report import (
        DEFAULT_WINDOW,
        KEY_BINS,
        LONG_MAX_BYTES,
        LongEncoder,
        render_long,
        resolve_window,
        sources_k,
    )

    limit = LONG_MAX_BYTES if max_bytes == DEFAULT_MAX_BYTES else max_bytes
    span = resolve_window(trace, window)
    kept = trace.kept_reductions(names[0]).top_keys  # without maps, no more than these
    k = sources_k(trace.num_tokens)
    k = k if trace.has_maps else min(k, 0 if kept is None else kept.shape[-1])
    signed = {}
    for name in names:
        r = trace.kept_reductions(name)
        values = (r.token_sums, r.first, r.top_values)
        signed[name] = declared_signed(name) or any(
            v is not None and bool((v < 0).any()) for v in values
        )
    with status("report: summary (first-token weight, entropy)", enabled=progress):
        table, chart = _summary_tables(trace)
    enc = LongEncoder(trace, names, span, k, signed, progress, len(wanted))
    title = title or f"Contribution weights · {trace.model_name or 'trace'}"
    meta: dict[str, Any] = {
        "version": FORMAT_VERSION,
        "view": "long",
        "title": title,
        "model": trace.model_name,
        "tokens": list(trace.tokens),
        "num_tokens": trace.num_tokens,
        "num_heads": trace.num_heads,
        "traced_layers": list(trace.layers),
        "measure_order": names,
        "measures": {n: measure_meta(n, signed[n]) for n in names},
        "window": None if span is None else list(span),
        "key_bins": min(trace.num_tokens, KEY_BINS),
        "default_window": DEFAULT_WINDOW,
        "sources_k": k,
        "summary": table,
        "first_token_weight": chart,
    }

    def notes_for(chosen: list[int]) -> list[str]:
        notes = []
        if span is None:
            notes.append(
                "This trace holds no maps (traced with maps=False / --no-maps): the page "
                "shows the per-token views, without the query × key window."
            )
        return notes + dropped_note(wanted, chosen, limit)

    def page_for(chosen: list[int]) -> str:
        chunks: dict[str, str] = {}
        for layer in chosen:
            chunks.update(enc.layer(layer))
        return render_long({**meta, "layers": chosen, "warnings": notes_for(chosen)}, chunks, title)

    return finish_page(enc, wanted, limit, page_for, notes_for, names, "uint8", "long")


class ReportOptions(TypedDict, total=False):
    """The keywords :func:`write_report` passes on to :func:`build_report` (their
    defaults are :func:`build_report`'s)."""

    measures: str | list[str] | tuple[str, ...] | None
    layers: list[int] | None
    max_bytes: int | None
    precision: str
    compact: bool
    title: str | None
    progress: bool
    view: str
    window: tuple[int, int] | None


def write_report(trace: Trace, path: str | Path, **options: Unpack[ReportOptions]) -> ReportInfo:
    """Write the interactive report of ``trace`` as one self-contained HTML file.

    Args:
        measures: measures to embed; default: those of attention, contribution, intra,
            vw, vw_on and distance that the trace holds; ``"all"`` for every one.
        layers: model layers to embed (default: all traced layers).
        max_bytes: size limit of the file (None: no limit). Over it, evenly spaced layers
            are kept and a :class:`ReportSizeWarning` says which were left out.
        precision: ``"uint8"`` (8 bits per value, scaled per query row) or ``"float16"``.
        compact: the smaller layout used in notebooks.
        title: page title (default: from the model name).
        progress: show a progress bar while encoding.
        view: ``"full"`` (every T × T map, quadratic in the length), ``"long"``
            (per-token heat over the whole text and the maps of a window of queries,
            linear in the length: :mod:`.long_report`; the only view of a trace without
            maps) or ``"auto"``: full up to 1,024 tokens, long beyond. The long view's
            default ``max_bytes`` is 20 MiB.
        window: the long view's queries ``(start, stop)`` whose maps are embedded
            (default: the last 128).
    """
    page, info = build_report(trace, **options)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    info.path = out
    return info


def notebook_html(
    trace: Trace, *, max_bytes: int | None = NOTEBOOK_MAX_BYTES, **kwargs: Any
) -> str:
    """The compact report inside an ``<iframe srcdoc>``, for Jupyter's display of a trace."""
    kwargs.setdefault("progress", False)
    page, _ = build_report(trace, max_bytes=max_bytes, compact=True, **kwargs)
    return (
        '<iframe class="cw-report" sandbox="allow-scripts" style="width:100%;height:640px;'
        'border:1px solid #ddd;border-radius:6px" srcdoc="'
        + html.escape(page, quote=True)
        + '"></iframe>'
    )


@dataclass
class EmbeddedReport:
    """The data read back from a report file: page metadata and decoded values."""

    meta: dict[str, Any]
    values: dict[tuple[str, str], np.ndarray]  # (measure, layer or "mean") -> (H+1, T, T)


def read_report(source: str | Path) -> EmbeddedReport:
    """Decode the data embedded in a report (a path, or the HTML text itself)."""
    meta, blobs = page_data(source)
    k, t = meta["num_heads"] + 1, meta["num_tokens"]
    values = {}
    for key, script_id in meta["chunks"].items():
        measure, layer = key.split("/")
        raw = base64.b64decode(blobs[script_id])
        signed = meta["measures"][measure]["signed"]
        values[(measure, layer)] = decode_chunk(raw, meta["precision"], signed, k, t)
    return EmbeddedReport(meta, values)
