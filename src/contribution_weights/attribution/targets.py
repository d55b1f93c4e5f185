"""What an end-to-end attribution explains: a scalar read from one position's prediction.

A :class:`Target` names the position whose next-token prediction is explained, the token
(None: the model's top prediction there), and the quantity (method §7.3):

* ``logprob`` (default): log P(token); the flow decomposes its linear part
  z_t − Σ_v P_v z_v, gradient methods explain log P itself;
* ``logit``: the token's logit z_t;
* ``contrast``: z_t − z_f, the logit difference against a foil token (contrastive
  explanations);
* ``flow``: no scalar: the pure contribution flow of the position's final state.

:func:`targets_for` builds and checks targets from what a user typed, before any model runs;
:func:`resolve` fills in the top predictions once logits exist; :func:`target_values`
reads each target's exact value from logits, the one definition every method shares.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where tensors are used: the CLI checks targets light
    from torch import Tensor

QUANTITIES = ("logprob", "logit", "contrast", "flow")


class TargetError(ValueError):
    """A target that cannot be explained (position out of range, bad token, ...): the
    message says what is wrong and how to fix it."""


@dataclass(frozen=True)
class Target:
    """One explained scalar: the prediction made at ``position`` (0-based) for the next
    token. ``token`` None means the model's top prediction; ``foil`` is the contrast's
    second token."""

    position: int
    token: int | None = None
    quantity: str = "logprob"
    foil: int | None = None

    def __post_init__(self) -> None:
        if self.quantity not in QUANTITIES:
            raise TargetError(
                f"unknown target quantity {self.quantity!r}; choose one of {', '.join(QUANTITIES)}"
            )
        if self.quantity == "contrast":
            if self.foil is None:
                raise TargetError("a contrast target needs a foil token (--foil)")
            if self.token is not None and self.token == self.foil:
                raise TargetError(
                    f"the contrast's token and foil are the same token ({self.token}); "
                    "a token contrasted with itself explains nothing: pick another foil"
                )
        elif self.foil is not None:
            raise TargetError(
                f"a foil is only used by contrast targets, not {self.quantity!r}: "
                "pass quantity='contrast' (--quantity contrast) or drop the foil"
            )

    @property
    def projected(self) -> bool:
        """Whether the target is a scalar (every quantity but ``flow``)."""
        return self.quantity != "flow"

    def describe(self, token_text: str | None = None, foil_text: str | None = None) -> str:
        what = token_text if token_text is not None else str(self.token)
        if self.quantity == "flow":
            return f"flow of position {self.position}"
        if self.quantity == "contrast":
            other = foil_text if foil_text is not None else str(self.foil)
            return f"logit({what!r}) − logit({other!r}) at position {self.position}"
        return f"{self.quantity}({what!r}) at position {self.position}"


def targets_for(
    num_tokens: int,
    *,
    position: int | None = None,
    token: int | None = None,
    foil: int | None = None,
    quantity: str = "logprob",
    continuation: Sequence[int] | None = None,
    vocab_size: int | None = None,
) -> list[Target]:
    """Checked targets for a sequence of ``num_tokens`` tokens.

    ``continuation``: the ids of a continuation already appended to the sequence (its last
    ``len(continuation)`` tokens): one target per continuation token, each the prediction
    of that token from everything before it. Else one target at ``position`` (default the
    last; negative counts from the end).
    """
    for name, value in (("token", token), ("foil", foil)):
        if value is not None and vocab_size is not None and not 0 <= value < vocab_size:
            raise TargetError(
                f"the {name} id {value} is outside the model's vocabulary (0..{vocab_size - 1})"
            )
    if continuation is not None:
        n = len(continuation)
        if n == 0:
            raise TargetError(
                "the continuation is empty: pass the text whose tokens should be explained"
            )
        if position is not None or token is not None:
            raise TargetError(
                "a continuation sets the positions and tokens itself; drop position/token"
            )
        if n >= num_tokens:
            raise TargetError("the continuation needs a prompt before it (at least one token)")
        start = num_tokens - n
        return [Target(start + k - 1, int(t), quantity, foil) for k, t in enumerate(continuation)]
    pos = num_tokens - 1 if position is None else position
    if pos < 0:
        pos += num_tokens
    if not 0 <= pos < num_tokens:
        raise TargetError(
            f"target position {position} is out of range: the text has {num_tokens} tokens "
            f"(positions 0..{num_tokens - 1}, or -1 for the last)"
        )
    return [Target(pos, token, quantity, foil)]


def resolve(targets: Sequence[Target], logits: Tensor) -> list[Target]:
    """Targets with their token filled in: the top prediction where it was None.
    ``logits``: ``(n, V)``, row k at ``targets[k].position``."""
    out = []
    for k, t in enumerate(targets):
        if t.token is None:
            top = int(logits[k].argmax())
            if t.quantity == "contrast" and top == t.foil:
                raise TargetError(
                    f"the model's top prediction at position {t.position} is the foil itself "
                    f"(token {top}); name the token to contrast with it"
                )
            t = replace(t, token=top)
        out.append(t)
    return out


def target_values(logits: Tensor, targets: Sequence[Target]) -> Tensor:
    """``(n,)``: each target's exact value from ``(n, V)`` logits (row k at target k's
    position; soft-capping already applied). ``flow`` targets read as NaN (no scalar)."""
    import torch

    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    out = torch.full((len(targets),), float("nan"), dtype=logits.dtype, device=logits.device)
    for k, t in enumerate(targets):
        if t.token is None:
            raise TargetError("resolve() the targets' tokens before reading their values")
        row = logits[k]
        if t.quantity == "logprob":
            out[k] = torch.log_softmax(row, -1)[t.token]
        elif t.quantity == "logit":
            out[k] = row[t.token]
        elif t.quantity == "contrast":
            assert t.foil is not None
            out[k] = row[t.token] - row[t.foil]
    return out
