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

The modules: :mod:`.items` (:class:`RulerItem`, the checks of a task's and a setting's
name), :mod:`.haystack` (tokens, the chat frame, the haystack and its needles),
:mod:`.generator` (the tasks' parameters, templates and word lists, and
:class:`RulerGenerator`) and :mod:`.scoring` (generation on a compressed cache and RULER's
metric).
"""

from __future__ import annotations

from .generator import (
    ADJECTIVES,
    CWE_ANSWER,
    CWE_AT,
    CWE_COMMON,
    CWE_FREQ,
    CWE_INTRO,
    CWE_QUESTION,
    DEPTHS,
    FWE_ALPHA,
    FWE_ANSWER,
    FWE_ANSWERS,
    FWE_INTRO,
    FWE_NOISE,
    FWE_QUESTION,
    FWE_WORD_LEN,
    MIN_HAYSTACK,
    NIAH_ANSWER,
    NIAH_INTRO,
    NIAH_NEEDLE,
    NIAH_QUESTION,
    NIAH_SHAPE,
    NOUNS,
    VT_ANSWER,
    VT_HOPS,
    VT_INTRO,
    VT_QUESTION,
    WORDS,
    RulerGenerator,
    ruler_item,
    ruler_items,
)
from .haystack import Haystack, chat_frame
from .items import RulerError, RulerItem, check_setting, check_task
from .scoring import ruler_score, ruler_scores, string_match_all

__all__ = [
    "ADJECTIVES",
    "CWE_ANSWER",
    "CWE_AT",
    "CWE_COMMON",
    "CWE_FREQ",
    "CWE_INTRO",
    "CWE_QUESTION",
    "DEPTHS",
    "FWE_ALPHA",
    "FWE_ANSWER",
    "FWE_ANSWERS",
    "FWE_INTRO",
    "FWE_NOISE",
    "FWE_QUESTION",
    "FWE_WORD_LEN",
    "MIN_HAYSTACK",
    "NIAH_ANSWER",
    "NIAH_INTRO",
    "NIAH_NEEDLE",
    "NIAH_QUESTION",
    "NIAH_SHAPE",
    "NOUNS",
    "VT_ANSWER",
    "VT_HOPS",
    "VT_INTRO",
    "VT_QUESTION",
    "WORDS",
    "Haystack",
    "RulerError",
    "RulerGenerator",
    "RulerItem",
    "chat_frame",
    "check_setting",
    "check_task",
    "ruler_item",
    "ruler_items",
    "ruler_score",
    "ruler_scores",
    "string_match_all",
]
