"""Fitting a report into its size limit: the most evenly spaced layers whose page fits,
the page's note on those left out, and what was embedded (:class:`ReportInfo`). Both
views (:mod:`.report`'s full view and :mod:`.long_report`) choose their layers with it."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from ..fields import int_ranges


class ReportSizeWarning(UserWarning):
    """The report left out layers to stay under its size limit."""


@dataclass
class ReportInfo:
    """What :func:`write_report` embedded, and where."""

    path: Path | None
    size_bytes: int
    measures: list[str]
    layers: list[int]
    dropped_layers: list[int]
    precision: str
    warnings: list[str] = field(default_factory=list)
    view: str = "full"


class LayerEncoder(Protocol):
    """A view's chunks, encoded on first use (:class:`~.report_encoder.FullEncoder`,
    :class:`~.long_report.LongEncoder`)."""

    def layer(self, layer: int) -> object: ...

    def layer_bytes(self, layer: int) -> int: ...

    def estimate(self, layers: list[int]) -> float: ...

    def close(self) -> None: ...


def evenly_spaced(items: list[int], k: int) -> list[int]:
    """``k`` items spread evenly over ``items``, first and last included (k ≥ 2)."""
    if k >= len(items):
        return list(items)
    if k == 1:
        return [items[len(items) // 2]]
    idx = np.round(np.linspace(0, len(items) - 1, k)).astype(int)
    return [items[i] for i in idx]


def choose_layers(
    enc: LayerEncoder,
    wanted: list[int],
    max_bytes: int,
    page_for: Callable[[list[int]], str],
) -> tuple[list[int], str] | None:
    """The most evenly spaced layers whose page fits in ``max_bytes``, and that page.

    Every candidate that is checked is rendered and measured exactly; an estimate from
    the layers encoded so far only skips candidates that are clearly too large, so most
    layers that do not make it into the file are never encoded.
    """
    base = len(page_for([]).encode())
    enc.layer(wanted[-1])
    for k in range(len(wanted), 0, -1):
        candidate = evenly_spaced(wanted, k)
        # layers differ (sliding-window layers compress far better than global ones),
        # so only an estimate twice over the limit is trusted to rule a candidate out
        if base + enc.estimate(candidate) > 2 * max_bytes:
            continue
        page = page_for(candidate)
        if len(page.encode()) <= max_bytes:
            return candidate, page
    return None


def fit_layers(
    enc: LayerEncoder,
    wanted: list[int],
    max_bytes: int | None,
    page_for: Callable[[list[int]], str],
) -> tuple[list[int], str]:
    """Every wanted layer without a limit, else :func:`choose_layers`'s choice, or an
    error that says by how much one layer is over."""
    if max_bytes is None:
        return wanted, page_for(wanted)
    found = choose_layers(enc, wanted, max_bytes, page_for)
    if found is None:
        enc.close()
        one = len(page_for([]).encode()) + min(enc.layer_bytes(x) for x in wanted[-1:])
        raise ValueError(
            f"even one layer makes the report larger than max_bytes={max_bytes:,} "
            f"(about {mib(one)}); raise max_bytes (CLI: --max-bytes), embed "
            "fewer measures, or trace a shorter text"
        )
    return found


def dropped_note(
    wanted: list[int], chosen: list[int], max_bytes: int | None, extra: str = ""
) -> list[str]:
    """The page's note on the layers left out for size (none when all fit)."""
    if chosen == wanted or max_bytes is None:
        return []
    dropped = [layer for layer in wanted if layer not in chosen]
    return [
        f"All {len(wanted)} layers would not fit the limit of "
        f"{max_bytes / 2**20:.1f} MiB: embedded {len(chosen)} evenly spaced layers "
        f"({', '.join(map(str, chosen))}); left out {int_ranges(dropped)}. {extra}"
        "Raise max_bytes (cw report --max-bytes), pick layers, or embed fewer measures."
    ]


def finish_page(
    enc: LayerEncoder,
    wanted: list[int],
    max_bytes: int | None,
    page_for: Callable[[list[int]], str],
    notes_for: Callable[[list[int]], list[str]],
    names: list[str],
    precision: str,
    view: str,
) -> tuple[str, ReportInfo]:
    """Both views' last step: the layers that fit, the page, a warning for those left out
    (the last note), and what was embedded."""
    chosen, page = fit_layers(enc, wanted, max_bytes, page_for)
    enc.close()
    notes = notes_for(chosen)
    if chosen != wanted:
        warnings.warn(ReportSizeWarning(notes[-1]), stacklevel=4)
    info = ReportInfo(
        path=None,
        size_bytes=len(page.encode()),
        measures=names,
        layers=list(chosen),
        dropped_layers=[layer for layer in wanted if layer not in chosen],
        precision=precision,
        warnings=notes,
        view=view,
    )
    return page, info


def mib(size: int) -> str:
    """A size in MiB as a message shows it (small ones in KiB, never "0.0 MiB")."""
    return f"{size / 2**20:.1f} MiB" if size >= 2**19 else f"{max(1, round(size / 2**10))} KiB"
