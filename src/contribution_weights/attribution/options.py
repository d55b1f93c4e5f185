"""Options of an attribution, declared once: :func:`~.run.attribute` and ``cw attribute``
share them (each field's flag, help and default). Light: the command line builds its
parser from this module before torch is imported."""

from __future__ import annotations

from dataclasses import dataclass

from ..fields import Options, option, split_names
from .methods import METHODS
from .targets import QUANTITIES, TargetError

COMPUTE_DTYPES = ("float32", "float64")
#: the default method: in the published known-answer runs of both embedded models
#: ``direct`` finds the answer's source as often as the best of the others (ties
#: included), never less often than ``flow`` and more often in five of six
#: (docs/attribution.md), at about the cost of one forward
DEFAULT_METHODS = ("direct",)


@dataclass
class AttributeOptions(Options):
    """What to explain and how (checked on creation; bad values raise ``TargetError``)."""

    position: int | None = option(
        None, "position whose next-token prediction is explained (default: the last; "
        "negative counts from the end)", flag="--position", parse="int",
    )  # fmt: skip
    token: int | str | None = option(
        None, "the predicted token to explain, as its text (it must be one token); "
        "default: the model's top prediction", flag="--token",
    )  # fmt: skip
    token_id: int | None = option(None, "the token to explain, as an id", flag="--token-id",
                                  parse="int")  # fmt: skip
    foil: int | str | None = option(
        None, "contrast: the token the target is compared with (its text)", flag="--foil"
    )
    foil_id: int | None = option(None, "contrast: the foil as an id", flag="--foil-id",
                                 parse="int")  # fmt: skip
    quantity: str = option(
        "logprob", "what is explained: logprob, logit, contrast (with --foil) or flow "
        "(the pure contribution flow, no projection)", flag="--quantity", choices=QUANTITIES,
    )  # fmt: skip
    continuation: str | list[int] | None = option(
        None, "explain every token of this continuation of the text, each from the prompt "
        "and the continuation tokens before it", flag="--continuation",
    )  # fmt: skip
    methods: list[str] = option(
        list(DEFAULT_METHODS),
        "attribution methods, comma-separated or 'all' (`cw attribute --help` describes each)",
        flag="--methods", parse="names", aliases=("--method",),
    )  # fmt: skip
    steps: int = option(50, "integrated gradients: interpolation steps", flag="--steps",
                        parse="int")  # fmt: skip
    routes: bool = option(False, "also extract the routes (read from flow, added if absent)",
                          flag="--routes", parse="flag")  # fmt: skip
    threshold: float = option(
        0.02, "routes: keep edges carrying at least this share of the target's total",
        flag="--threshold", parse="float",
    )  # fmt: skip
    compute_dtype: str = option("float32", "dtype of the flow's arithmetic",
                                flag="--compute-dtype", choices=COMPUTE_DTYPES)  # fmt: skip
    max_tokens: int | None = option(None, "longest input accepted, a continuation included "
                                    "(default: the model's context length)",
                                    flag="--max-tokens", parse="int")  # fmt: skip
    truncate: bool = option(False, "keep the first --max-tokens tokens of a longer text "
                            "(not with --continuation: its prompt is never cut)",
                            flag="--truncate", parse="flag")  # fmt: skip

    def validate(self) -> None:
        if self.token is not None and self.token_id is not None:
            raise TargetError("give the token as text (--token) or as an id (--token-id), not both")
        if self.foil is not None and self.foil_id is not None:
            raise TargetError("give the foil as text (--foil) or as an id (--foil-id), not both")
        if self.token_id is not None:
            self.token, self.token_id = self.token_id, None
        if self.foil_id is not None:
            self.foil, self.foil_id = self.foil_id, None
        if self.quantity not in QUANTITIES:
            raise TargetError(
                f"unknown quantity {self.quantity!r}; choose one of {', '.join(QUANTITIES)}"
            )
        if self.quantity == "contrast" and self.foil is None:
            raise TargetError("a contrast needs a foil token: pass --foil TEXT (or foil=...)")
        if self.foil is not None and self.quantity != "contrast":
            raise TargetError(
                f"a foil is only read by --quantity contrast, not {self.quantity!r}; "
                "add --quantity contrast or drop --foil"
            )
        if self.token is not None and self.foil is not None and self.token == self.foil:
            raise TargetError(
                "the contrast's token and foil are the same; a token contrasted with itself "
                "explains nothing: pick another foil"
            )
        if self.continuation is not None:
            if isinstance(self.continuation, str):
                empty = not self.continuation.strip()
            else:
                self.continuation = [int(i) for i in self.continuation]
                empty = not self.continuation
            if empty:
                raise TargetError(
                    "the continuation is empty: pass the text whose tokens should be explained"
                )
            if self.position is not None or self.token is not None:
                raise TargetError(
                    "--continuation sets the positions and tokens itself; drop --position/--token"
                )
            if self.truncate:
                raise TargetError(
                    "a continuation's prompt is never truncated (cutting its end would change "
                    "what the continuation follows): drop --truncate, and shorten the text or "
                    "raise --max-tokens if it is too long"
                )
        self.methods = METHODS.resolve(split_names(self.methods) or list(DEFAULT_METHODS))
        if self.routes and "flow" not in self.methods:
            self.methods.append("flow")  # the routes are read from the contribution flow
        if self.steps < 1:
            raise TargetError(f"--steps must be at least 1, not {self.steps}")
        if not 0 < self.threshold < 1:
            raise TargetError(f"--threshold is a share in (0, 1), not {self.threshold}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise TargetError(
                f"compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, not "
                f"{self.compute_dtype!r}"
            )
        if self.max_tokens is not None and self.max_tokens < 2:
            raise TargetError(f"--max-tokens must be at least 2, not {self.max_tokens}")
