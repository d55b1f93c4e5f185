"""Long-context tasks in the manner of RULER (Hsieh et al., 2024), generated from a seed.

Seven tasks, each item a prompt of exactly ``length`` tokens and the answers it asks for:

* ``niah_single``: one needle "One of the special magic numbers for KEY is: VALUE." (KEY an
  adjective-noun pair, VALUE 7 digits) in a haystack of FineWeb-Edu text; asked: KEY.
* ``niah_multikey``: four needles with four keys; one is asked, three are distractors.
* ``niah_multivalue``: four needles with the same key and four values; all four are asked.
* ``niah_multiquery``: four needles with four keys; all four keys are asked.
* ``vt`` (variable tracking): "VAR A = 12345.", "VAR B = VAR A.", … five variables in a chain,
  the statements spread over a FineWeb-Edu haystack; asked: every variable equal to 12345.
* ``cwe`` (common words): a numbered list of words in which ten words occur many times
  (30 at 4,096 tokens) and the others a few times (3); asked: the ten most common.
* ``fwe`` (frequent words): a stream of made-up "coded" words whose counts follow a Zipf
  law (α = 2; the most frequent is the noise "....", to be ignored); asked: the three most
  frequent words.

The haystack is real text, never repeated filler: an item starts at a seeded text and takes
consecutive texts, sentence by sentence, until the length is filled, the last sentence cut
at a token. Needles go between sentences, at the boundary nearest their depth (the
fraction of the haystack before them). Every piece (the template's parts, each sentence,
each needle, each list entry) is tokenised on its own and the pieces' ids concatenated,
so a needle's ids are exactly those of its text, and the length is exact: the haystack is
cut to the tokens left (cwe and fwe, which have no haystack, pad the last few tokens with
newlines). A needle whose ids do not decode back to its text is an error.

A prompt is ``context`` (the model's chat template's start when its tokenizer has one, the
instruction, the haystack), ``question`` and ``answer_prefix`` (the chat template's
assistant turn and the start of the answer, e.g. "The special magic numbers for KEY
mentioned in the provided text are"). The two settings of kvpress:

* ``query_agnostic``: ``context`` is prefilled and compressed; the question and the answer
  prefix are fed after compression, so compression cannot know what will be asked.
* ``query_aware``: ``context`` and ``question`` are prefilled (the question sits in the
  observation window) and compressed; the answer prefix is fed after compression.

Scoring (RULER's ``string_match_all``): the model generates greedily after the answer
prefix (at most twice the answer's tokens plus 4); an item scores the share of its
expected answers found, case-insensitively, in the generated text (0 or 1 for one answer).

Templates follow RULER's in spirit (its wording, its task parameters at 4,096 tokens);
differences: no in-context example for vt, the word lists are this module's own, the
haystack of every haystack task is FineWeb-Edu rather than Paul Graham's essays or
repeated sentences, and cwe's frequencies scale with the length (30 and 3 at 4,096).
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..defaults import RULER_SETTINGS, RULER_TASKS
from ..loading import LoadedModel
from .cache import CompressedCache, stack_caches

#: the needle depths of niah_single, dealt in turn over the items (passkey's scheme)
DEPTHS = tuple(round(0.05 + 0.1 * k, 2) for k in range(10))
#: fewest haystack tokens an item may have after its template and needles
MIN_HAYSTACK = 16
#: needles of the niah tasks: (keys, values per key, keys asked)
NIAH_SHAPE = {
    "niah_single": (1, 1, 1),
    "niah_multikey": (4, 1, 1),
    "niah_multivalue": (1, 4, 1),
    "niah_multiquery": (4, 1, 4),
}
VT_HOPS = 4  # a chain of VT_HOPS + 1 variables
CWE_COMMON = 10  # words asked for
CWE_FREQ = (30, 3)  # occurrences of a common and of an uncommon word at CWE_AT tokens
CWE_AT = 4096
FWE_ALPHA = 2.0
FWE_ANSWERS = 3
FWE_WORD_LEN = 6
FWE_NOISE = "...."

NIAH_INTRO = (
    "Some special magic numbers are hidden within the following text. Make sure to "
    "memorize it. I will quiz you about the numbers afterwards.\n"
)
NIAH_NEEDLE = "One of the special magic numbers for {key} is: {value}."
NIAH_QUESTION = "What are all the special magic numbers for {query} mentioned in the provided text?"
NIAH_ANSWER = "The special magic numbers for {query} mentioned in the provided text are"
VT_INTRO = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
)
VT_QUESTION = "Question: Find all variables that are assigned the value {value} in the text above."
VT_ANSWER = (
    "Answer: According to the chain(s) of variable assignment in the text above, {n} "
    "variables are assigned the value {value}, they are:"
)
CWE_INTRO = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n"
)
CWE_QUESTION = f"Question: What are the {CWE_COMMON} most common words in the above list?"
CWE_ANSWER = f"Answer: The top {CWE_COMMON} words that appear most often in the list are:"
FWE_INTRO = (
    "Read the following coded text and track the frequency of each coded word. Find the "
    "three most frequently appeared coded words."
)
FWE_QUESTION = (
    "Question: Do not provide any explanation. Please ignore the dots '....'. What are the "
    "three most frequently appeared words in the above coded text?"
)
FWE_ANSWER = (
    "Answer: According to the coded text above, the three most frequently appeared words are:"
)

_NOUNS = """apple river mountain garden window candle bridge forest island harbor pencil
ladder mirror basket blanket bottle button camera carpet castle cloud coffee copper cotton
desert dragon engine falcon feather fence finger flower fountain galaxy guitar hammer helmet
honey jacket jungle kettle kitten lantern lemon letter lizard magnet marble meadow melody
monkey needle noodle ocean orchard oyster paddle palace parrot pepper pillow planet pocket
potato puzzle rabbit radio ribbon rocket saddle salmon sandal season shadow shelter shovel
singer sister spider spoon squirrel stable statue sticker stone summer sunset teacher temple
thunder ticket tiger tomato tower tractor trumpet tunnel turtle valley village violin wagon
walnut wizard wolf yogurt zebra anchor arrow badge barrel beacon beetle blossom boulder
bracelet breeze cabin cactus canyon carrot cedar cherry chimney circus clover compass crystal
cushion daisy dolphin donkey drum eagle elbow ember ferry fiddle flame glacier goose granite
harvest hedge heron horizon insect ivory jewel journal kayak kernel lagoon lemonade lobster
locket maple meteor mitten moss mustard napkin nest oak olive otter owl panda pebble pelican
piano pine pirate plum pond poppy pumpkin quilt raven reef robin saffron sailor scarf shell
skate sparrow spring storm sugar swan tablet thistle timber tulip umbrella unicorn vase
violet walrus whale willow wren yacht"""
_ADJECTIVES = """ancient bitter brave bright broad calm careful cheerful clever cold crisp
curious damp dark deep distant dry dusty eager early elegant empty fancy fierce fluffy
fragile fresh friendly frozen gentle giant glossy golden graceful grumpy happy heavy hidden
hollow honest humble icy jolly kind large lazy little lively lonely loud lucky mellow mighty
misty modern muddy narrow neat noble noisy odd pale patient plain polite proud purple quick
quiet rapid rare rich rough round royal rusty salty sandy scarlet shiny short silent silky
simple sleepy slow small smooth soft solid sour spicy steady sticky stormy strange strong
sunny sweet swift tall tame tender thick tidy tiny vivid warm wet wide wild wise witty
wooden young zesty"""
#: the keys of the niah needles are adjective-noun pairs
NOUNS = tuple(_NOUNS.split())
ADJECTIVES = tuple(_ADJECTIVES.split())
#: the words of cwe's lists
WORDS = tuple(dict.fromkeys(NOUNS + ADJECTIVES))

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\s*\n+\s*")


class RulerError(ValueError):
    """An item cannot be made as asked (length too short, haystack too small, …)."""


@dataclass(frozen=True)
class RulerItem:
    """One item: ``context`` + ``question`` + ``answer_prefix`` is the whole prompt.

    Attributes:
        task: one of :data:`~..defaults.RULER_TASKS`.
        context: ``(1, c)`` ids: chat start, instruction, haystack with the needles.
        question: ``(1, q)`` ids: prefilled in ``query_aware``, fed after in ``query_agnostic``.
        answer_prefix: ``(1, a)`` ids: the chat template's assistant turn and the start of
            the answer; always fed after compression.
        answers: the strings a correct answer contains.
        max_new_tokens: tokens generated after the answer prefix.
        meta: how the item was made: ``depths`` of the needles, ``depth`` of the (first)
            asked needle, keys, values, the counts of cwe and fwe, ``seed``.
    """

    task: str
    context: Tensor
    question: Tensor
    answer_prefix: Tensor
    answers: tuple[str, ...]
    max_new_tokens: int
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return int(self.context.shape[1] + self.question.shape[1] + self.answer_prefix.shape[1])

    def prompt(self) -> Tensor:
        """``(1, length)``: the whole prompt."""
        return torch.cat([self.context, self.question, self.answer_prefix], dim=1)

    def prefill_ids(self, setting: str) -> Tensor:
        """What is prefilled and compressed in ``setting``."""
        check_setting(setting)
        if setting == "query_aware":
            return torch.cat([self.context, self.question], dim=1)
        return self.context

    def fed_ids(self, setting: str) -> Tensor:
        """What is fed on the compressed cache before generating, in ``setting``."""
        check_setting(setting)
        if setting == "query_aware":
            return self.answer_prefix
        return torch.cat([self.question, self.answer_prefix], dim=1)


def check_setting(setting: str) -> str:
    if setting not in RULER_SETTINGS:
        raise ValueError(f"unknown setting {setting!r}; choose from {', '.join(RULER_SETTINGS)}")
    return setting


def check_task(task: str) -> str:
    if task not in RULER_TASKS:
        raise ValueError(f"unknown RULER task {task!r}; choose from {', '.join(RULER_TASKS)}")
    return task


# ---- tokens ------------------------------------------------------------------------------
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


# ---- the generator -----------------------------------------------------------------------
class RulerGenerator:
    """Items of the RULER-like tasks for one tokenizer and haystack (see the module doc).

    ``ruler_item(task, seed, length)`` is a function of its arguments, the tokenizer and the
    haystack texts only: the same seed gives the same ids.
    """

    def __init__(
        self, tokenizer: Any, texts: Sequence[str] | None = None, chat: bool | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.haystack = Haystack(texts, tokenizer) if texts else None
        self.head, self.tail = chat_frame(tokenizer, chat)
        self.chat = bool(self.tail)
        self._word_ids: dict[str, list[int]] = {}
        self._pad: list[int] | None = None

    # pieces
    def ids(self, text: str) -> list[int]:
        return _ids(self.tokenizer, text)

    def word(self, word: str) -> list[int]:
        if word not in self._word_ids:
            self._word_ids[word] = self.ids(" " + word)
        return self._word_ids[word]

    def pad(self) -> list[int]:
        """One token of whitespace, to make a word list's length exact."""
        if self._pad is None:
            for text in ("\n", " ", "."):
                ids = self.ids(text)
                if len(ids) == 1:
                    self._pad = ids
                    break
            else:
                raise RulerError("the tokenizer has no one-token newline, space or full stop")
        return self._pad

    def needle(self, text: str) -> list[int]:
        ids = self.ids(" " + text)
        back = " ".join(_decode(self.tokenizer, ids).split())
        if back != text:
            raise RulerError(f"the needle {text!r} does not survive tokenisation ({back!r})")
        return ids

    def item(self, task: str, seed: int, length: int, index: int = 0) -> RulerItem:
        """Item ``index`` of ``task`` at ``length`` tokens from ``seed`` (``index`` also
        picks niah_single's depth from :data:`DEPTHS`)."""
        check_task(task)
        if int(length) < 1:
            raise RulerError(f"length must be a positive number of tokens, not {length}")
        rng = random.Random(f"ruler:{task}:{seed}:{index}")
        length = int(length)
        answers: list[str] = []  # cwe, fwe: drawn with the list
        meta: dict[str, Any] = {}
        if task in NIAH_SHAPE:
            intro, question, prefix, answers, meta = self._niah(task, rng, index)
        elif task == "vt":
            intro, question, prefix, answers, meta = self._vt(rng)
        elif task == "cwe":
            intro, question, prefix = CWE_INTRO, CWE_QUESTION, CWE_ANSWER
        else:
            intro, question, prefix = FWE_INTRO, FWE_QUESTION, FWE_ANSWER
        start = self.head + self.ids(intro)
        q_ids = self.ids("\n" + question)
        a_ids = self.tail + self.ids(prefix if self.chat else " " + prefix)
        fixed = len(start) + len(q_ids) + len(a_ids)
        budget = length - fixed  # the haystack with its needles, or the word list
        if task == "cwe":
            body, answers, meta = self._cwe(rng, budget, length, fixed)
        elif task == "fwe":
            body, answers, meta = self._fwe(rng, budget, length, fixed)
        else:
            body, meta = self._haystack_body(task, rng, budget, meta, length, fixed)
        context = start + body
        answer_ids = self.ids(" " + ", ".join(answers))
        item = RulerItem(
            task=task,
            context=torch.tensor(context)[None],
            question=torch.tensor(q_ids)[None],
            answer_prefix=torch.tensor(a_ids)[None],
            answers=tuple(answers),
            max_new_tokens=2 * len(answer_ids) + 4,
            meta={**meta, "seed": seed, "index": index, "chat": self.chat},
        )
        if item.length != length:  # the construction makes it exact
            raise AssertionError(f"{task} item of {item.length} tokens, not {length}")
        return item

    # niah and vt: needles in a haystack
    def _niah(
        self, task: str, rng: random.Random, index: int
    ) -> tuple[str, str, str, list[str], dict[str, Any]]:
        n_keys, n_values, n_asked = NIAH_SHAPE[task]
        keys: list[str] = []
        while len(keys) < n_keys:
            key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
            if key not in keys:
                keys.append(key)
        values: list[str] = []
        while len(values) < n_keys * n_values:
            value = str(rng.randint(1_000_000, 9_999_999))
            if value not in values:
                values.append(value)
        needles = [
            (keys[k], values[k * n_values + v]) for k in range(n_keys) for v in range(n_values)
        ]
        rng.shuffle(needles)
        if len(needles) == 1:
            depths = [DEPTHS[index % len(DEPTHS)]]
        else:
            depths = sorted(rng.sample(DEPTHS, len(needles)))
        asked = keys[:n_asked] if n_asked > 1 else [rng.choice(keys)]
        rng.shuffle(asked)
        answers = [v for key in asked for (k, v) in needles if k == key]
        query = asked[0] if len(asked) == 1 else ", ".join(asked[:-1]) + ", and " + asked[-1]
        first = next(i for i, (k, _) in enumerate(needles) if k == asked[0])
        meta = {
            "needles": [NIAH_NEEDLE.format(key=k, value=v) for k, v in needles],
            "nominal_depths": depths,
            "depth": depths[first],
            "asked": asked,
        }
        return (
            NIAH_INTRO,
            NIAH_QUESTION.format(query=query),
            NIAH_ANSWER.format(query=query),
            answers,
            meta,
        )

    def _vt(self, rng: random.Random) -> tuple[str, str, str, list[str], dict[str, Any]]:
        names: list[str] = []
        while len(names) < VT_HOPS + 1:
            name = "".join(rng.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ", k=5))
            if name not in names:
                names.append(name)
        value = str(rng.randint(10000, 99999))
        chain = [f"VAR {names[0]} = {value}."]
        chain += [f"VAR {names[k + 1]} = VAR {names[k]}." for k in range(VT_HOPS)]
        depths = sorted(round(rng.random(), 4) for _ in chain)
        meta = {"needles": chain, "nominal_depths": depths, "value": value}
        return (
            VT_INTRO,
            VT_QUESTION.format(value=value),
            VT_ANSWER.format(n=len(names), value=value),
            list(names),
            meta,
        )

    def _haystack_body(
        self,
        task: str,
        rng: random.Random,
        budget: int,
        meta: dict[str, Any],
        length: int,
        fixed: int,
    ) -> tuple[list[int], dict[str, Any]]:
        if self.haystack is None:
            raise RulerError(f"the {task} task needs haystack texts (FineWeb-Edu)")
        needles = [self.needle(text) for text in meta["needles"]]
        hay = budget - sum(len(n) for n in needles)
        if hay < MIN_HAYSTACK:
            need = fixed + sum(len(n) for n in needles) + MIN_HAYSTACK
            raise RulerError(
                f"a {task} item of {length} tokens is too short for its template and needles "
                f"({fixed + sum(len(n) for n in needles)} tokens with this tokenizer) and a "
                f"haystack of at least {MIN_HAYSTACK}; use a length of at least {need}"
            )
        start = rng.randrange(len(self.haystack.texts))
        pieces, used = self.haystack.take(start, hay)
        body, landed = _with_needles(
            pieces, list(zip(meta["nominal_depths"], needles, strict=True))
        )
        return body, {**meta, "depths": landed, "texts": used, "haystack_tokens": hay}

    # cwe and fwe: word lists
    def _cwe(
        self, rng: random.Random, budget: int, length: int, fixed: int
    ) -> tuple[list[int], list[str], dict[str, Any]]:
        scale = length / CWE_AT
        f_uncommon = max(1, round(CWE_FREQ[1] * scale))
        f_common = max(f_uncommon + 1, round(CWE_FREQ[0] * scale))
        words = list(WORDS)
        rng.shuffle(words)
        common, rest = words[:CWE_COMMON], words[CWE_COMMON:]
        numbers: list[list[int]] = []

        def cost(n_uncommon: int) -> int:
            entries = CWE_COMMON * f_common + n_uncommon * f_uncommon
            while len(numbers) < entries:
                numbers.append(self.ids(f" {len(numbers) + 1}."))
            own = f_common * sum(len(self.word(w)) for w in common)
            own += f_uncommon * sum(len(self.word(w)) for w in rest[:n_uncommon])
            return own + sum(len(n) for n in numbers[:entries])

        if cost(0) > budget:
            raise RulerError(
                f"a cwe item of {length} tokens is too short for {CWE_COMMON} words "
                f"{f_common} times each after its template ({fixed} tokens); use a longer length"
            )
        n = 0
        while n < len(rest) and cost(n + 1) <= budget:
            n += 1
        if n == len(rest):
            raise RulerError(
                f"a cwe item of {length} tokens needs more distinct words than the list's "
                f"{len(WORDS)}; use a shorter length"
            )
        entries = [w for w in common for _ in range(f_common)]
        entries += [w for w in rest[:n] for _ in range(f_uncommon)]
        rng.shuffle(entries)
        body: list[int] = []
        for k, w in enumerate(entries):
            body += numbers[k] + self.word(w)
        body += self.pad() * (budget - len(body))
        meta = {"counts": {w: entries.count(w) for w in dict.fromkeys(entries)}}
        return body, list(common), meta

    def _fwe(
        self, rng: random.Random, budget: int, length: int, fixed: int
    ) -> tuple[list[int], list[str], dict[str, Any]]:
        zeta = math.pi**2 / 6 if FWE_ALPHA == 2 else sum(k**-FWE_ALPHA for k in range(1, 10**5))
        most = int(math.isqrt(max(budget, 1)) + 2)  # words that can occur at all
        vocab = [FWE_NOISE]
        while len(vocab) < most + 1:
            word = "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=FWE_WORD_LEN))
            if word not in vocab:
                vocab.append(word)

        def counts(n: int) -> list[int]:
            return [int(n * k**-FWE_ALPHA / zeta) for k in range(1, len(vocab) + 1)]

        def cost(n: int) -> int:
            return sum(c * len(self.word(w)) for c, w in zip(counts(n), vocab, strict=True))

        lo, hi = 0, max(budget, 0)
        while lo < hi:  # the most words whose stream fits
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if cost(mid) <= budget else (lo, mid - 1)
        c = counts(lo)
        if not (c[1] > c[2] > c[3] > c[4] > 0):
            raise RulerError(
                f"a fwe item of {length} tokens is too short for three clearly most frequent "
                f"words after its template ({fixed} tokens); use a longer length"
            )
        stream = [w for w, k in zip(vocab, c, strict=True) for _ in range(k)]
        rng.shuffle(stream)
        body = [i for w in stream for i in self.word(w)]
        body += self.pad() * (budget - len(body))
        meta = {"counts": {w: k for w, k in zip(vocab, c, strict=True) if k}}
        return body, vocab[1 : 1 + FWE_ANSWERS], meta


def ruler_item(
    task: str,
    seed: int,
    length: int,
    tokenizer: Any,
    texts: Sequence[str] | None = None,
    index: int = 0,
    chat: bool | None = None,
) -> RulerItem:
    """One item of ``task`` of exactly ``length`` tokens (see :class:`RulerGenerator`)."""
    return RulerGenerator(tokenizer, texts, chat).item(task, seed, length, index)


def ruler_items(
    model: LoadedModel,
    tasks: Sequence[str],
    length: int,
    n: int,
    seed: int,
    texts: Sequence[str] | None,
) -> list[RulerItem]:
    """``n`` items of each task in turn (task 0's n items, then task 1's, …)."""
    generator = RulerGenerator(model.tokenizer, texts)
    return [generator.item(task, seed, length, j) for task in tasks for j in range(n)]


# ---- scoring -----------------------------------------------------------------------------
def string_match_all(output: str, answers: Sequence[str]) -> float:
    """RULER's metric: the share of ``answers`` found (case-insensitive) in ``output``."""
    text = output.lower()
    return sum(a.lower() in text for a in answers) / len(answers) if answers else 0.0


def ruler_score(
    model: LoadedModel, cache: CompressedCache, item: RulerItem, setting: str
) -> dict[str, Any]:
    """Greedy generation on the compressed cache after the setting's fed ids; the accuracy
    (:func:`string_match_all`) and the generated text."""
    return ruler_scores(model, [cache], item, setting)[0]


def ruler_scores(
    model: LoadedModel, caches: Sequence[CompressedCache], item: RulerItem, setting: str
) -> list[dict[str, Any]]:
    """:func:`ruler_score` for several compressed caches of one prefill at once: stacked as
    the rows of one batch (:func:`~.cache.stack_caches`), generated together, each row cut
    at its first end-of-sequence token as its own generation would have stopped there."""
    fed = item.fed_ids(setting).to(model.model.device)
    kwargs: dict[str, Any] = {"max_new_tokens": item.max_new_tokens, "do_sample": False}
    config = getattr(model.model, "generation_config", None)
    eos = None if config is None else config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if config is not None and config.pad_token_id is None:
        kwargs["pad_token_id"] = (eos[0] if isinstance(eos, list) else eos) or 0
    stacked = stack_caches(caches)
    with torch.no_grad():
        out = stacked.generate(model.model, fed.expand(len(caches), -1), **kwargs)
    scores = []
    for row in out[:, fed.shape[1] :].tolist():
        end = next((k + 1 for k, token in enumerate(row) if token in stops), len(row))
        output = _decode(model.tokenizer, row[:end]).strip()
        scores.append({"accuracy": string_match_all(output, item.answers), "output": output})
    return scores
