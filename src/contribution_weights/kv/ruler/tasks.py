"""The RULER-like tasks' parameters, templates and word lists, and :class:`RulerItem`,
one item of a task (see :mod:`~..ruler`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ...defaults import RULER_SETTINGS, RULER_TASKS

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
