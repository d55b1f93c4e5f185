"""What every self-contained HTML page of the package shares: its packaged assets, JSON
safe inside a ``<script>``, the chunk tag a report embeds its data in, the filling of
a template's placeholders, and reading a written page's JSON back. Below :mod:`.report`,
:mod:`.long_report` and :mod:`.attribution_html`, which all build pages with it."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from importlib.resources import files
from pathlib import Path
from typing import Any

#: one embedded, compressed chunk of a report's data
CHUNK_TAG = '<script type="application/x-cw-chunk" id="{id}">{data}</script>\n'
#: what a page may load (its ``__CW_CSP__``): nothing from elsewhere, only its own inline
#: script and styles and data: images
PAGE_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:"
)
#: a report's too: its chunks are inflated through blob: and data: URLs
REPORT_CSP = PAGE_CSP + " blob:; connect-src blob: data:"


def asset(name: str) -> str:
    """A packaged asset (``presentation/assets/NAME``): template, style sheet or script."""
    return files("contribution_weights.presentation").joinpath("assets", name).read_text("utf-8")


def styles(*names: str) -> str:
    """A page's style sheet: the shared ``base.css``, then the page's own sheets."""
    return "".join(asset(n) for n in ("base.css", *names))


def json_for_script(obj: Any) -> str:
    """JSON that is safe inside a ``<script>`` element (no ``</script>``, no U+2028)."""
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


#: a template line ``<!--cw:include NAME-->`` stands for the asset NAME (the pages' shared
#: head, report header and closing script)
_INCLUDE = re.compile(r"^<!--cw:include ([\w.-]+)-->\n", re.M)


def template(name: str) -> str:
    """The asset ``name`` with its includes replaced by the assets they name."""
    return _INCLUDE.sub(lambda m: template(m.group(1)), asset(name))


def fill(name: str, parts: Mapping[str, str]) -> str:
    """The template ``name`` (:func:`template`) with each placeholder of ``parts``
    replaced, in one pass (a part's text is never searched for placeholders)."""
    pattern = re.compile("|".join(re.escape(k) for k in parts))
    return pattern.sub(lambda m: parts[m.group(0)], template(name))


def estimate_bytes(
    layer_bytes: Callable[[int], int], encoded: list[int], layers: list[int]
) -> float:
    """Bytes of these layers: exact where encoded, the mean of those elsewhere."""
    known = [layer_bytes(x) for x in encoded]
    mean = sum(known) / len(known) if known else 0.0
    return sum(layer_bytes(x) if x in encoded else mean for x in layers)


def page_text(source: str | Path) -> str:
    """A page's HTML: ``source`` itself when it is HTML text, else the file it names."""
    text = str(source)
    if "<html" not in text[:2000].lower():
        text = Path(source).read_text("utf-8")
    return text


def json_script(text: str, script_id: str) -> str | None:
    """The content of the page's ``<script type="application/json" id="SCRIPT_ID">``, or
    None when it has none."""
    pattern = rf'<script type="application/json" id="{re.escape(script_id)}">(.*?)</script>'
    found = re.search(pattern, text, re.S)
    return None if found is None else found.group(1)
