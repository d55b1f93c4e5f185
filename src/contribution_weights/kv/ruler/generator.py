"""The generator of the RULER-like items: the tasks' parameters, templates and word lists,
and :class:`RulerGenerator`, an item of any task from a seed for one tokenizer and
haystack."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import torch

from ...loading import LoadedModel
from .haystack import Haystack, _decode, _ids, _with_needles, chat_frame
from .items import RulerError, RulerItem, check_task

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
