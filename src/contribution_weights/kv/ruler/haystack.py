"""Tokens of the RULER-like items: the chat frame around the user's message, the
haystack of real text cut into sentences, and the needles placed between them."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from .items import RulerError

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\s*\n+\s*")


def _ids(tokenizer: Any, text: str) -> list[int]:
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    try:
        return str(tokenizer.decode(list(ids), skip_special_tokens=True))
    except TypeError:  # a minimal tokenizer without the keyword
        return str(tokenizer.decode(list(ids)))


def chat_frame(tokenizer: Any, chat: bool | None = None) -> tuple[list[int], list[int]]:
    """(start, end) ids around the user's message: the chat template's, when the tokenizer
    has one (and ``chat`` is not False), else the tokenizer's own special start (BOS) and
    nothing."""
    template = getattr(tokenizer, "chat_template", None)
    if chat is not False and template and hasattr(tokenizer, "apply_chat_template"):
        mark = "\x00MESSAGE\x00"
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": mark}], tokenize=False, add_generation_prompt=True
        )
        if isinstance(text, str) and text.count(mark) == 1:
            head, tail = text.split(mark)
            return _ids(tokenizer, head), _ids(tokenizer, tail)
        if chat:
            raise RulerError("the tokenizer's chat template does not hold a user message")
    elif chat:
        raise RulerError("the tokenizer has no chat template")
    return [int(i) for i in tokenizer("", add_special_tokens=True)["input_ids"]], []


class Haystack:
    """Texts cut into sentences, each tokenised once (with its leading space, or newline at
    the start of a text): the haystack of every item made from it."""

    def __init__(self, texts: Sequence[str], tokenizer: Any) -> None:
        self.texts = [t for t in texts if t.strip()]
        if not self.texts:
            raise RulerError("the haystack needs at least one non-empty text (FineWeb-Edu)")
        self.tokenizer = tokenizer
        self._pieces: dict[int, list[list[int]]] = {}

    def sentences(self, doc: int) -> list[str]:
        parts = (" ".join(s.split()) for s in _SENTENCE_END.split(self.texts[doc].strip()))
        return [p for p in parts if p]

    def pieces(self, doc: int) -> list[list[int]]:
        if doc not in self._pieces:
            sentences = self.sentences(doc)
            self._pieces[doc] = [
                _ids(self.tokenizer, ("\n" if k == 0 else " ") + s) for k, s in enumerate(sentences)
            ]
        return self._pieces[doc]

    def take(self, start: int, tokens: int) -> tuple[list[list[int]], list[int]]:
        """Sentences from text ``start`` on (each text at most once) holding ``tokens``
        tokens, the last one cut; and the texts used."""
        out: list[list[int]] = []
        used: list[int] = []
        have = 0
        for k in range(len(self.texts)):
            doc = (start + k) % len(self.texts)
            used.append(doc)
            for piece in self.pieces(doc):
                if have + len(piece) >= tokens:
                    out.append(piece[: tokens - have])
                    return out, used
                out.append(piece)
                have += len(piece)
        raise RulerError(
            f"the haystack texts hold {have} tokens, fewer than the {tokens} an item needs; "
            "give more texts (FineWeb-Edu)"
        )


def _with_needles(
    pieces: list[list[int]], needles: Sequence[tuple[float, list[int]]]
) -> tuple[list[int], list[float]]:
    """The haystack's ids with each needle at the sentence boundary nearest its depth; and
    the depths they landed at (fraction of the haystack before them)."""
    total = sum(len(p) for p in pieces)
    bounds = [(0, 0)]  # (tokens before, piece index): before each piece; the cut one stays last
    for k, p in enumerate(pieces[:-1]):
        bounds.append((bounds[-1][0] + len(p), k + 1))
    at: dict[int, list[list[int]]] = {}
    landed = []
    for depth, ids in needles:
        target = depth * total
        pos, k = min(bounds, key=lambda b: (abs(b[0] - target), b[0]))
        at.setdefault(k, []).append(ids)
        landed.append(round(pos / total, 4) if total else 0.0)
    out: list[int] = []
    for k, piece in enumerate(pieces):
        for ids in at.get(k, []):
            out.extend(ids)
        out.extend(piece)
    return out, landed
