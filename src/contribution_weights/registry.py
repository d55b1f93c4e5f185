"""One registry type for everything found by name: measures, KV-cache methods, geometry
analyses, model families.

A :class:`Registry` holds items keyed by a name the item carries (``item.name`` unless
told otherwise), resolves aliases the item declares (``item.aliases``), and reads the
spellings users write: ``"all"``, one name, ``"a,b"``, a list that may hold ``"all"``
(``"all,distance"``). Unknown names fail with the valid ones listed and the nearest
spelling suggested, the same words everywhere.

Pure Python: importing it costs nothing, so the command line can build its choices from a
registry before any heavy import.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterable, Iterator
from types import ModuleType
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(ValueError):
    """A name that no registered item has (a ``ValueError``: the CLI reports it as such)."""


class Registry(Generic[T]):
    """Items of one kind, registered by name, in registration order.

    Args:
        kind: what an item is, for messages ("measure", "KV-cache method").
        key: an item's name (default ``item.name``).
        in_all: whether an item belongs to ``"all"`` (default every item).
        plural: ``kind`` in the plural, where adding an "s" would be wrong.
    """

    def __init__(
        self,
        kind: str,
        *,
        key: Callable[[T], str] = lambda item: str(item.name),  # type: ignore[attr-defined]
        in_all: Callable[[T], bool] = lambda item: True,
        plural: str | None = None,
    ) -> None:
        self.kind = kind
        self.plural = plural or f"{kind}s"
        self._key = key
        self._in_all = in_all
        self._items: dict[str, T] = {}

    # ---- registering ------------------------------------------------------------------------
    def register(self, item: T) -> T:
        """Add ``item`` (or replace the one of its name); returns it, so it can decorate."""
        name = self._key(item)
        if not name:
            raise ValueError(f"a {self.kind} needs a name")
        self._items[name] = item
        return item

    def unregister(self, name: str) -> T | None:
        """Remove an item (tests, plugins that withdraw one); None when there was none."""
        return self._items.pop(name, None)

    # ---- reading ---------------------------------------------------------------------------
    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._canonical(name) in self._items

    def __iter__(self) -> Iterator[T]:
        return iter(list(self._items.values()))

    def __len__(self) -> int:
        return len(self._items)

    def names(self) -> list[str]:
        """Every registered name, in registration order."""
        return list(self._items)

    def all_names(self) -> list[str]:
        """The names that ``"all"`` stands for."""
        return [name for name, item in self._items.items() if self._in_all(item)]

    def get(self, name: str) -> T:
        """The item called ``name`` (or one of its aliases), else :class:`UnknownNameError`."""
        canonical = self._canonical(name)
        if canonical in self._items:
            return self._items[canonical]
        raise UnknownNameError(self._unknown(name))

    __getitem__ = get

    def resolve(self, spec: str | Iterable[str] | None) -> list[str]:
        """Canonical names, checked and deduplicated, in the order given.

        ``None`` and ``"all"`` are :meth:`all_names`; a string is split on commas; a list
        may hold ``"all"`` beside other names (``["all", "distance"]``).
        """
        if spec is None:
            return self.all_names()
        parts = spec.split(",") if isinstance(spec, str) else list(spec)
        names: list[str] = []
        unknown: list[str] = []
        for part in (str(p).strip() for p in parts):
            if not part:
                continue
            if part != "all" and part not in self:
                unknown.append(part)
                continue
            for name in self.all_names() if part == "all" else [self._key(self.get(part))]:
                if name not in names:
                    names.append(name)
        if len(unknown) == 1:
            raise UnknownNameError(self._unknown(unknown[0]))
        if unknown:  # every unknown name at once, not one per attempt
            shown = ", ".join(f"{u!r}{self._did_you_mean(u)}" for u in unknown)
            raise UnknownNameError(
                f"unknown {self.plural} {shown}; valid {self.plural}: {self._valid()}"
            )
        if not names:
            raise UnknownNameError(f"no {self.kind} named; valid {self.plural}: {self._valid()}")
        return names

    # ---- helpers ---------------------------------------------------------------------------
    def _aliases(self) -> dict[str, str]:
        return {
            alias: name
            for name, item in self._items.items()
            for alias in getattr(item, "aliases", ()) or ()
        }

    def _canonical(self, name: str) -> str:
        return name if name in self._items else self._aliases().get(name, name)

    def _valid(self) -> str:
        return ", ".join(self._items) or "(none registered)"

    def _did_you_mean(self, name: str) -> str:
        """`` (did you mean 'x'?)`` with the closest registered name, or nothing."""
        close = difflib.get_close_matches(name, [*self._items, *self._aliases()], n=1)
        return f" (did you mean {close[0]!r}?)" if close else ""

    def _unknown(self, name: str) -> str:
        message = f"unknown {self.kind} {name!r}; valid {self.plural}: {self._valid()}"
        return message + self._did_you_mean(name)


__all__ = ["Registry", "UnknownNameError"]


def import_if_present(name: str) -> ModuleType | None:
    """Import the module ``name`` (where plugins and registered entries live); None when
    that module itself cannot be found. A module that is found but fails, a missing
    import inside it included, raises as it would."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name is None or not (name == err.name or name.startswith(err.name + ".")):
            raise  # the module was found; something it imports is missing
    return None
