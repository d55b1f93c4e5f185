"""Input handling shared by tracing and the experiments: texts or ids to checked token ids,
layer indices to model layers, ids to token strings.

Everything here sits below :mod:`.tracing` and :mod:`.experiments`; it knows the loaded
model's tokenizer and size, and nothing of capture or measures.

Token strings (:func:`token_strings`). A byte-level tokenizer may split one character (an
emoji, most CJK characters, Hebrew or Arabic letters) over several tokens; decoding such
a token alone gives "\ufffd". Instead, each token's text is the difference between the
decoded text up to and including it and the decoded text before it (over a short window
of preceding tokens, so the cost stays linear). A token that holds only the leading bytes
of a character shows those bytes as a visible marker, e.g. ``⟨f0 9f 98⟩``, and the token
that completes the character shows the whole character. The ids are never changed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor

from .loading import LoadedModel


class InputError(ValueError):
    """Bad input to a trace or an experiment: the message says what is wrong and how to fix it."""


def resolve_layers(
    layers: Sequence[int] | None, num_layers: int, *, allow_empty: bool = False
) -> list[int]:
    """Model layer indices, sorted and deduplicated; negative indices count from the end.

    An empty list is an error (it names no layer to trace) unless ``allow_empty``, for
    callers where "no layer" is a meaningful choice (e.g. no sink layer to scale).
    """
    if layers is None:
        return list(range(num_layers))
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        raise InputError(
            f"layers must be a list of layer indices such as [0, 5, -1], not {layers!r}"
        )
    if len(layers) == 0 and not allow_empty:
        raise InputError(
            "layers=[] names no layer to trace; pass layer indices such as [0, 5, -1], "
            "or layers=None for all layers"
        )
    out: list[int] = []
    bad: list[int] = []
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, int):
            try:
                layer = int(layer)  # numpy and torch integers
            except (TypeError, ValueError):
                raise InputError(f"layer {layer!r} is not a whole number") from None
        idx = layer + num_layers if layer < 0 else layer
        if not 0 <= idx < num_layers:
            bad.append(layer)  # every bad index is named, not just the first (0-40 of 30)
        elif idx not in out:
            out.append(idx)
    if bad:
        named = _runs(sorted(set(bad)))
        which = f"layer {named} is" if len(set(bad)) == 1 else f"layers {named} are"
        raise InputError(
            f"{which} out of range: the model has {num_layers} layers (valid: "
            f"0..{num_layers - 1}, or {-num_layers}..-1 from the end); pick layers in that "
            "range"
        )
    return sorted(out)


def _runs(values: list[int]) -> str:
    """Sorted integers as runs: ``[30, 31, …, 40, 45]`` -> ``"30..40, 45"``."""
    parts: list[str] = []
    start = prev = values[0]
    for v in [*values[1:], None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        parts.append(str(start) if start == prev else f"{start}..{prev}")
        if v is not None:
            start = prev = v
    return ", ".join(parts)


def encode(
    model: LoadedModel, text: str | Sequence[int] | Tensor, max_tokens: int | None, truncate: bool
) -> Tensor:
    """Token ids ``(T,)`` for a text or ids, checked against the length limit."""
    if isinstance(text, str):
        if not text.strip():
            raise InputError("the text is empty; pass some text to trace")
        ids = torch.tensor(model.tokenizer(text, add_special_tokens=True)["input_ids"])
    else:
        ids = _as_ids(text)
    if ids.numel() == 0:
        raise InputError("no tokens to trace; pass a non-empty text or id list")
    _check_vocabulary(model, ids)
    if max_tokens is not None and max_tokens < 1:
        raise InputError(f"max_tokens must be at least 1, not {max_tokens}")
    limit = max_tokens or model.max_positions
    if limit is not None and ids.numel() > limit:
        if not truncate:
            what = "--max-tokens" if max_tokens else "the model's context length"
            raise InputError(
                f"the text has {ids.numel()} tokens, more than {limit} ({what}); "
                "pass truncate=True (CLI: --truncate) to keep the first "
                f"{limit} tokens, or shorten the text"
            )
        ids = ids[:limit]
    return ids


def texts_of_length(
    model: LoadedModel,
    texts: Sequence[str],
    min_tokens: int,
    *,
    join: bool = False,
    n: int | None = None,
    separator: str = "\n\n",
) -> list[str]:
    """The first ``n`` texts that have at least ``min_tokens`` tokens (with the tokenizer's
    special tokens, as :func:`encode` counts them).

    ``join=False`` skips shorter texts. ``join=True`` joins consecutive texts (``separator``
    between them) until each joined text reaches ``min_tokens`` tokens, for corpora of
    short items (GSM8K); a last group that stays short is dropped. Experiments then cut
    each text to its first ``max_tokens`` tokens, so with ``min_tokens == max_tokens``
    every sequence has exactly that length.
    """
    if min_tokens < 1:
        raise InputError(f"min_tokens must be at least 1, not {min_tokens}")
    if n is not None and n < 1:
        raise InputError(f"n must be a positive number of texts, not {n}")

    def count(text: str) -> int:
        return len(model.tokenizer(text, add_special_tokens=True)["input_ids"])

    out: list[str] = []
    group: list[str] = []
    for text in texts:
        if n is not None and len(out) == n:
            break
        if not text.strip():
            continue
        if not join:
            if count(text) >= min_tokens:
                out.append(text)
            continue
        group.append(text.strip())
        joined = separator.join(group)
        if count(joined) >= min_tokens:
            out.append(joined)
            group = []
    return out


def _as_ids(value: Sequence[int] | Tensor) -> Tensor:
    try:
        ids = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as err:
        raise InputError(
            f"token ids must be a flat list of whole numbers or an integer tensor ({err})"
        ) from None
    if ids.numel() == 0:
        return ids.to(torch.long).reshape(-1)
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise InputError(
            f"token ids must be whole numbers, not {str(ids.dtype).removeprefix('torch.')}; "
            "pass a list of ints or a torch.long tensor"
        )
    if ids.dim() > 1 and ids.shape[:-1].numel() != 1:
        raise InputError(
            f"token ids of shape {tuple(ids.shape)} hold several sequences; encode one "
            "sequence at a time (a flat list of ids, or a (1, T) tensor)"
        )
    return ids.to(torch.long).reshape(-1)


def vocabulary_size(model: LoadedModel) -> int | None:
    """Rows of the model's input embedding (the ids it accepts), or the config's vocab_size."""
    try:
        return int(model.model.get_input_embeddings().num_embeddings)
    except (AttributeError, TypeError, NotImplementedError):
        size = getattr(model.text_config, "vocab_size", None)
        return int(size) if size else None


def _check_vocabulary(model: LoadedModel, ids: Tensor) -> None:
    bad_low = (ids < 0).nonzero().flatten()
    if bad_low.numel():
        k = int(bad_low[0])
        raise InputError(
            f"token id {int(ids[k])} at position {k} is negative ({bad_low.numel()} negative "
            "ids in all); token ids are indices into the vocabulary, 0 or more"
        )
    size = vocabulary_size(model)
    if size is not None:
        bad_high = (ids >= size).nonzero().flatten()
        if bad_high.numel():
            k = int(bad_high[0])
            raise InputError(
                f"token id {int(ids[k])} at position {k} is outside the vocabulary: the model "
                f"has {size} token ids (0..{size - 1}); {bad_high.numel()} ids are out of range. "
                "Were these ids made by another model's tokenizer?"
            )


# ---- token strings ---------------------------------------------------------------------
REPLACEMENT = "\ufffd"
_WINDOW = 8  # preceding tokens decoded with each token: context for spaces and merges
_MAX_PARTIAL = 8  # tokens one character may span before they are shown one by one
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-unicode table used by byte-level BPE vocabularies."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


def token_bytes(tokenizer: Any, token_id: int) -> bytes | None:
    """The raw bytes of a token when the vocabulary spells them out (byte-level BPE, or
    SentencePiece byte-fallback tokens such as ``<0xF0>``); None otherwise."""
    try:
        piece = tokenizer.convert_ids_to_tokens(int(token_id))
    except Exception:
        return None
    if not isinstance(piece, str) or not piece:
        return None
    found = _BYTE_TOKEN.fullmatch(piece)
    if found:
        return bytes([int(found.group(1), 16)])
    table = _byte_decoder()
    if all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    return None


def _hex(raw: bytes) -> str:
    return "⟨" + " ".join(f"{b:02x}" for b in raw) + "⟩" if raw else ""


def _split_run(tokenizer: Any, run: list[int], text: str) -> list[str] | None:
    """Texts of the tokens of ``run``, which together decode to ``text``: each complete
    character goes to the token holding its last byte, and the bytes of a character a token
    leaves unfinished are shown on it as ``⟨hex⟩``. None when the bytes are not known."""
    import codecs

    pieces = [token_bytes(tokenizer, i) for i in run]
    if any(p is None for p in pieces):
        return None
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    shown = []
    for raw in pieces:
        assert raw is not None
        done = decoder.decode(raw, final=False)
        pending = decoder.getstate()[0]  # the unfinished bytes, a suffix of the stream
        shown.append(done + _hex(pending[len(pending) - min(len(pending), len(raw)) :]))
    if "".join(_HEX.sub("", x) for x in shown) != text:
        return None  # the decoder adds or drops something the bytes do not show
    return shown


_HEX = re.compile(r"⟨[0-9a-f ]+⟩")


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids)) if ids else ""


def token_strings(model: LoadedModel, ids: Tensor) -> list[str]:
    """The text of each token, faithful for characters split over tokens (see the module
    docstring): concatenated they give the decoded text, except that a token holding only
    the first bytes of a character shows those bytes as ``⟨hex⟩``."""
    tokenizer = model.tokenizer
    seq = [int(i) for i in ids]
    out: list[str] = [""] * len(seq)
    start: int | None = None  # first token of an unfinished character
    for k in range(len(seq)):
        base = k if start is None else start
        a = max(0, base - _WINDOW)
        before = _decode(tokenizer, seq[a:base])
        text = _decode(tokenizer, seq[a : k + 1])
        # a decoder that is not prefix-stable gives the token decoded alone
        stable = text.startswith(before)
        delta = text[len(before) :] if stable else _decode(tokenizer, [seq[k]])
        unfinished = delta.endswith(REPLACEMENT) and k + 1 < len(seq)
        if unfinished and k - base + 1 < _MAX_PARTIAL:
            if start is None:
                start = k
            continue
        if start is not None and not delta.endswith(REPLACEMENT):
            split = _split_run(tokenizer, seq[start : k + 1], delta)
            if split is None:  # bytes unknown: markers before, the whole text on the last
                split = [_hex(token_bytes(tokenizer, j) or b"") or "⟨…⟩" for j in seq[start:k]]
                split.append(delta)
            out[start : k + 1] = split
        elif start is not None:  # never completed: each token on its own
            for j in range(start, k + 1):
                out[j] = _decode(tokenizer, [seq[j]])
        else:
            out[k] = delta
        start = None
    return out
