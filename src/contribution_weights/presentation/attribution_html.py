"""The interactive page of an :class:`~..attribution.result.Attribution`.

:func:`write_attribution_html` writes ONE self-contained HTML file (script, styles and data
inline; nothing is fetched, so it opens offline and can be shared as is). The page shows
the text with each token's background coloured by its score under the chosen method for
the chosen target (red drives the target up, blue down; each method and target on its own
scale), a strip per method over all tokens, and the target's routes drawn as SVG from the
embedded edges (levels × positions). With several targets (a continuation) the outputs
are clickable, in a row of their own and in the text, and show their target's attribution
and routes. Hovering a token shows its score under every method.

The tokens are written into the page as escaped HTML (the page reads as text without its
script); the data, JSON in a ``<script type="application/json">`` element, holds each
target's scores up to its position (later tokens cannot drive it), to 6 significant digits.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

from ..attribution.result import Attribution
from .page import PAGE_CSP, asset, fill, json_for_script, json_script, page_text, styles

FORMAT_VERSION = 1
DATA_ID = "cw-attribution"


def _num(value: float) -> float | None:
    """A finite value to 6 significant digits (short in JSON); None for NaN or infinity."""
    return float(f"{value:.6g}") if math.isfinite(value) else None


def method_note(result: Attribution, name: str, k: int) -> str:
    """The note under a method's scores for target ``k``: the value it decomposes, its
    remainder and its time, where known (the page and the figures show the same)."""
    parts = []
    explained = result.explained.get(name)
    if explained is not None and k < len(explained) and math.isfinite(explained[k]):
        parts.append(f"decomposes {explained[k]:.4g}")
        remainder = result.remainder.get(name)
        if remainder is not None and k < len(remainder) and math.isfinite(remainder[k]):
            parts.append(f"remainder {remainder[k]:.2g}")
    if name in result.seconds:
        parts.append(f"{result.seconds[name]:.2f} s")
    return "; ".join(parts)


def page_data(result: Attribution, title: str) -> dict[str, Any]:
    """What the page embeds (and :func:`read_attribution_html` reads back)."""
    t = len(result.tokens)
    targets = []
    for k, target in enumerate(result.targets):
        p = target.position
        targets.append(
            {
                "position": p,
                "quantity": target.quantity,
                "token": result.target_tokens[k],
                "value": _num(result.values[k]),
                "description": result.describe_target(k),
                # the token the target predicts, when it is in the text (a continuation)
                "output": p + 1 if p + 1 < t and target.token == result.ids[p + 1] else None,
            }
        )
    scores = {
        name: [
            [_num(v) for v in values[k, : result.targets[k].position + 1].tolist()]
            for k in range(len(result.targets))
        ]
        for name, values in result.scores.items()
    }
    routes = None
    if result.routes is not None:
        by_target = {r.target: r for r in result.routes}
        routes = [
            None
            if k not in by_target
            else {
                "position": by_target[k].position,
                "threshold": by_target[k].threshold,
                "num_layers": by_target[k].num_layers,
                "edges": [
                    [e.layer, e.source, e.target, e.head, _num(e.weight)]
                    for e in by_target[k].edges
                ],
            }
            for k in range(len(result.targets))
        ]
    return {
        "version": FORMAT_VERSION,
        "title": title,
        "model": result.model,
        "tokens": list(result.tokens),
        "methods": result.methods,
        "targets": targets,
        "scores": scores,
        "notes": {
            m: [method_note(result, m, k) for k in range(len(targets))] for m in result.methods
        },
        "routes": routes,
    }


def _token_html(token: str) -> str:
    """A token as page text: escaped, a newline shown as ↵ and kept as a line break."""
    if token == "":
        return '<span class="empty">∅</span>'
    pieces = token.replace("\r", "").split("\n")
    nl = '<span class="nl">↵</span>\n'
    return nl.join(html.escape(piece, quote=True) for piece in pieces)


def _shown(token: str) -> str:
    """A token on a button: whitespace made visible."""
    text = token.replace("\n", "↵").replace("\r", "").replace("\t", "⇥").replace(" ", "·")
    return html.escape(text or "∅", quote=True)


def build_attribution_html(result: Attribution, *, title: str | None = None) -> str:
    """The page's HTML text (see :func:`write_attribution_html`)."""
    if not result.targets:
        raise ValueError("this attribution has no targets: there is nothing to show")
    title = title or f"Attribution · {result.model}"
    data = page_data(result, title)
    tokens = "".join(
        f'<span class="tok" data-i="{i}">{_token_html(tok)}</span>'
        for i, tok in enumerate(result.tokens)
    )
    outputs = "".join(
        f'<button type="button" class="out" data-k="{k}" title="{html.escape(t["description"])}">'
        f'<span class="k">{k}</span>{_shown(t["token"])}</button>'
        for k, t in enumerate(data["targets"])
    )
    n = len(result.targets)
    several = n > 1
    methods = ", ".join(result.methods)
    subtitle = (
        f"{result.model} · {len(result.tokens)} tokens · {n} target{'s' if several else ''} · "
        f"methods {methods}" + ("" if result.routes is not None else " · no routes")
    )
    parts = {
        "__CW_CSP__": PAGE_CSP,
        "__CW_TITLE__": html.escape(title),
        "__CW_SUBTITLE__": html.escape(subtitle),
        "__CW_OUTPUTS_HEADING__": "Outputs" if several else "Target",
        "__CW_OUTPUTS_HINT__": (
            "Click an output (here or underlined in the text) to see what drove it."
            if several
            else "The prediction explained."
        ),
        "__CW_OUTPUTS__": outputs,
        "__CW_TOKENS__": tokens,
        "/*__CW_CSS__*/": styles("attribution.css"),
        "//__CW_JS__": asset("attribution.js"),
        "__CW_DATA__": json_for_script(data),
    }
    return fill("attribution.html", parts)


def write_attribution_html(
    result: Attribution, path: str | Path, *, title: str | None = None
) -> Path:
    """Write the interactive page of ``result`` as one self-contained HTML file.

    The text coloured by each token's score (a method selector; each method and target on
    its own scale), a strip per method, and the routes of the chosen target as SVG (when
    the result has them: ``routes=True``). With several targets (a continuation), clicking
    an output shows its target. Returns the path written.
    """
    page = build_attribution_html(result, title=title)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out


def read_attribution_html(source: str | Path) -> dict[str, Any]:
    """The data embedded in a page written by :func:`write_attribution_html` (a path, or
    the HTML text itself)."""
    found = json_script(page_text(source), DATA_ID)
    if found is None:
        raise ValueError("this HTML holds no attribution data (no #cw-attribution element)")
    data: dict[str, Any] = json.loads(found)
    return data
