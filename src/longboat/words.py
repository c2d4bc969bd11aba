"""Counts in the words users read: ``plural(1, "rank")`` is ``1 rank``, ``plural(2, "rank")``
``2 ranks``."""

from __future__ import annotations


def plural(count: int, noun: str, many: str | None = None) -> str:
    """``count`` and ``noun``, in the plural (``many``, or ``noun`` + "s") unless ``count`` is 1."""
    return f"{count} {noun if count == 1 else many or noun + 's'}"
