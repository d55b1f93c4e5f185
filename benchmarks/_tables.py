"""Number formats of the benchmarks' Markdown tables, as the docs print them (a minus sign,
not a hyphen; a value that rounds to zero without a sign)."""

from __future__ import annotations


def signed(x: float, digits: int = 3) -> str:
    """``x`` with its sign and ``digits`` decimals (``+0.125``, ``−0.020``, ``0.000``)."""
    text = f"{x:+.{digits}f}"
    return text[1:] if float(text) == 0 else text.replace("-", "−")


def plain(x: float, digits: int = 2) -> str:
    """``x`` with ``digits`` decimals, a minus sign where negative."""
    return f"{x:.{digits}f}".replace("-", "−")
