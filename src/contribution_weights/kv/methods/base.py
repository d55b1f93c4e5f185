"""The base of the KV-cache methods: :class:`Method`, the registry they are found in by
name, and the helpers their scores share (protected positions, the window's keys).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from ...registry import Registry
from .stats import STATISTICS, LayerStats, Scores

N_SINK = 4


@dataclass(frozen=True)
class Method:
    """A named eviction score ``LayerStats -> (B, G, T)``, higher = keep.

    Subclasses add their parameters as fields and override :meth:`score`; ``needs`` names
    the statistics it reads (:data:`STATISTICS`). ``window`` (on methods that look at the
    observation window) is a number of the last prefill queries, None for the prefill's
    whole window.
    """

    name: str
    description: str = ""
    needs: ClassVar[tuple[str, ...]] = ()
    #: whether its KV heads keep different counts: :func:`~..cache.compress` then keeps what
    #: :meth:`kept_mask` says instead of each head's best ``kept`` by score
    head_adaptive: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not isinstance(self.description, str):
            raise TypeError(
                f"method {self.name!r}: description must be text; a score function goes in a "
                "Method subclass's score() (or Method.of(name, function, description))"
            )

    def score(self, stats: LayerStats) -> Scores:
        raise NotImplementedError(f"{type(self).__name__} has no score()")

    def score_for_budget(self, stats: LayerStats, kept: int) -> Scores:
        """The scores when ``kept`` entries per KV head will be kept (:func:`~..cache.compress`
        calls this). Most methods ignore the budget; those that split it (a recent window
        as a share of it, a first selection stage) override this."""
        return self.score(stats)

    def kept_mask(self, stats: LayerStats, kept: int) -> Tensor:
        """``(B, G, T)`` bool, what a head-adaptive method keeps for a budget of ``kept``
        entries per KV head on average (``G · kept`` per layer and batch row)."""
        raise NotImplementedError(f"{type(self).__name__} keeps the same count in every head")

    @property
    def window_queries(self) -> int | None:
        """The observation-window queries it reads (None: the prefill's whole window)."""
        return getattr(self, "window", None)

    @staticmethod
    def of(
        name: str,
        score: Callable[[LayerStats], Tensor],
        description: str = "",
        needs: tuple[str, ...] = STATISTICS,
    ) -> Method:
        """A method from a plain function of the statistics (gathers every statistic
        unless ``needs`` says which it reads)."""
        return _FunctionMethod(name, description, function=score, function_needs=needs)


@dataclass(frozen=True)
class _FunctionMethod(Method):
    function: Callable[[LayerStats], Tensor] | None = None
    function_needs: tuple[str, ...] = STATISTICS

    @property
    def gathers(self) -> tuple[str, ...]:
        return self.function_needs

    def score(self, stats: LayerStats) -> Scores:
        assert self.function is not None
        return self.function(stats)


def method_needs(method: Method) -> tuple[str, ...]:
    """The statistics a method reads (its class's ``needs``, or a function method's own)."""
    return tuple(getattr(method, "gathers", type(method).needs))


METHODS: Registry[Method] = Registry("KV-cache method")


def register_method(method: Method) -> Method:
    """Add (or replace) a method; ``cw kv-eval`` and :func:`~..cache.compress` find it by name."""
    return METHODS.register(method)


def get_method(name: str | Method) -> Method:
    """A registered method by name (a :class:`Method` instance is returned as it is)."""
    return name if isinstance(name, Method) else METHODS.get(name)


def method_names() -> list[str]:
    return METHODS.names()


def resolve_methods(methods: str | Iterable[str] | None) -> list[str]:
    """``"all"``, one name, ``"a,b"`` or a list: checked and deduplicated."""
    return METHODS.resolve(methods)


# ---- helpers -----------------------------------------------------------------------------
def _protect_last(scores: Scores, n: int) -> Scores:
    """Give the last ``n`` positions a score above every other (kept first)."""
    if n <= 0:
        return scores
    out = scores.clone()
    out[..., -n:] = scores.max() + 1
    return out


def _protect_first(scores: Scores, n: int) -> Scores:
    """Give the first ``n`` positions a score above every other, including protected ones."""
    if n <= 0:
        return scores
    out = scores.clone()
    out[..., :n] = scores.max() + 2
    return out


def _window_keys(stats: LayerStats, window: int | None) -> int:
    """Keys of the observation window (all but one position when the prefill is shorter)."""
    return min(stats._window(window), stats.length - 1)


def _window_text(window: int | None) -> str:
    return f"the last {window} queries" if window else "the observation window's queries"


@dataclass(frozen=True)
class WindowSum(Method):
    """A per-head statistic summed over the window's queries (:meth:`of_window`) and the
    query heads of each KV group; the window's own keys are always kept, and the first
    ``sinks`` tokens (``contribution`` and ``renormalised``)."""

    window: int | None = None
    sinks: int = 0

    def of_window(self, stats: LayerStats) -> Tensor:
        """``(B, H, T)``: the statistic summed over the last ``window`` queries."""
        raise NotImplementedError(f"{type(self).__name__} has no of_window()")

    def score(self, stats: LayerStats) -> Scores:
        scores = stats.per_kv_head(self.of_window(stats), reduce="sum")
        scores = _protect_last(scores, _window_keys(stats, self.window))
        return _protect_first(scores, self.sinks)
