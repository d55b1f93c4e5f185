"""The tasks behind ``cw kv-eval``: language modelling and passkey retrieval.

Language modelling (``lm``). An item is ``C + 129`` tokens of running text. The first
``C`` are prefilled and the cache compressed; tokens ``C … C+127`` are then fed on the
compressed cache and the mean NLL of tokens ``C+1 … C+128`` is the score (128
predictions, every one made through the compressed cache; the prefill's own prediction
of token ``C`` is left out since compression cannot change it). Texts shorter than
``C + 129`` tokens are joined to the following ones with a blank line (GSM8K items are a
few hundred tokens, so each LM item there is several consecutive problems).

Passkey retrieval (``passkey``). A context of exactly ``C`` tokens: an instruction, filler
sentences, and "The pass key is K. Remember it. K is the pass key." with a 5-digit K at a
controlled depth (fraction of the filler before it); all drawn from a seed. The context
is prefilled and compressed; then "What is the pass key? The pass key is" and the answer
are fed. The item is correct when the model's greedy prediction reproduces every answer
token (teacher-forced argmax, which equals greedy generation of the answer). The question
is not part of the prefill, so compression cannot know what will be asked (kvpress's
query-agnostic setting).
"""

from __future__ import annotations

import random as _random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..loading import LoadedModel
from .cache import CompressedCache

CONTINUATION = 128
DEPTHS = (0.1, 0.35, 0.65, 0.9)
INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and "
    "memorize it. I will quiz you about the important information there.\n"
)
FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
QUESTION = "\nWhat is the pass key? The pass key is"


def continuation_nll(logits: Tensor, targets: Tensor) -> float:
    """Mean NLL of ``targets`` ``(B, n)`` under ``logits`` ``(B, n, V)`` (aligned: logit i
    predicts target i). The log-softmax runs in float32 (float64 for float64 logits): a
    float64 copy of a 262k-entry vocabulary per position cost a third of a Gemma 3 item,
    and bfloat16 would round each log-probability; the mean is taken in float64."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logp = torch.log_softmax(logits.detach(), dim=-1, dtype=dtype)
    picked = logp.gather(-1, targets.to(logp.device)[..., None])
    return float(-picked.double().mean())


# ---- language modelling ------------------------------------------------------------------
def lm_items(
    model: LoadedModel, texts: Iterable[str], context: int, n: int | None
) -> Iterator[Tensor]:
    """Items of ``context + CONTINUATION + 1`` tokens, consecutive texts joined when short."""
    need = context + CONTINUATION + 1
    parts: list[str] = []
    made = 0
    for text in texts:
        if not text.strip():
            continue
        parts.append(text)
        ids = model.tokenizer("\n\n".join(parts), add_special_tokens=True)["input_ids"]
        if len(ids) >= need:
            yield torch.tensor(ids[:need])
            parts = []
            made += 1
            if n is not None and made >= n:
                return


def lm_item(ids: Tensor, context: int) -> tuple[Tensor, Tensor]:
    """(prefill ids, fed continuation ids), both ``(1, ·)``."""
    return ids[None, :context], ids[None, context : context + CONTINUATION + 1]


def lm_score(model: LoadedModel, cache: CompressedCache, fed: Tensor) -> dict[str, float]:
    with torch.no_grad():
        logits = cache.forward(model.model, fed[:, :-1].to(model.model.device)).logits
    return {"nll": continuation_nll(logits, fed[:, 1:]), "n_tokens": CONTINUATION}


# ---- passkey -----------------------------------------------------------------------------
@dataclass(frozen=True)
class PasskeyItem:
    context: Tensor  # (1, C)
    question: Tensor  # (1, q): question tokens
    answer: Tensor  # (1, a): answer tokens
    key: str
    depth: float


def _tokens(model: LoadedModel, text: str, special: bool = False) -> list[int]:
    return list(model.tokenizer(text, add_special_tokens=special)["input_ids"])


def passkey_item(model: LoadedModel, context: int, depth: float, seed: int) -> PasskeyItem:
    """One passkey item of exactly ``context`` tokens, the needle at ``depth`` of the filler."""
    rng = _random.Random(seed)
    key = str(rng.randint(10000, 99999))
    intro = _tokens(model, INTRO, special=True)
    needle = _tokens(model, f" The pass key is {key}. Remember it. {key} is the pass key. ")
    # filler starts at a seeded sentence so that items differ beyond the key
    sentences = FILLER.split(". ")
    start = rng.randrange(len(sentences))
    text = ". ".join(sentences[start:] + sentences[:start])
    filler = _tokens(model, text * (context // 4 + 2))
    budget = context - len(intro) - len(needle)
    if budget < 8:
        raise ValueError(f"context of {context} tokens is too short for the passkey task")
    before = round(depth * budget)
    ids = intro + filler[:before] + needle + filler[before:budget]
    assert len(ids) == context
    question = _tokens(model, QUESTION)
    answer = _tokens(model, f" {key}")
    return PasskeyItem(
        context=torch.tensor(ids)[None],
        question=torch.tensor(question)[None],
        answer=torch.tensor(answer)[None],
        key=key,
        depth=depth,
    )


def passkey_items(
    model: LoadedModel, context: int, n: int, seed: int, depths: Sequence[float] = DEPTHS
) -> Iterator[PasskeyItem]:
    for i in range(n):
        yield passkey_item(model, context, depths[i % len(depths)], seed * 100_003 + i)


def passkey_score(
    model: LoadedModel, cache: CompressedCache, item: PasskeyItem
) -> dict[str, float]:
    fed = torch.cat([item.question, item.answer[:, :-1]], dim=1).to(model.model.device)
    with torch.no_grad():
        logits = cache.forward(model.model, fed).logits
    a = item.answer.shape[1]
    pred_logits = logits[:, -a:]
    target = item.answer.to(pred_logits.device)
    correct = bool((pred_logits.argmax(-1) == target).all())
    logp = torch.log_softmax(pred_logits.double(), dim=-1).gather(-1, target[..., None])
    return {"accuracy": float(correct), "answer_nll": float(-logp.mean())}
