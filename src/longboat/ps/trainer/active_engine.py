"""The engine of the last ``distribute`` in this process (``lb.ps.current()``); closing it or
``lb.shutdown()`` forgets it. Its own module so that what reaches the engine through it
(``table_admin``) needs no import of ``engine``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from longboat.cluster import on_shutdown

if TYPE_CHECKING:
    from longboat.ps.trainer.engine import PSEngine

_current: PSEngine | None = None  # read through current(); forgotten at lb.shutdown()


def make_current(engine: PSEngine) -> None:
    """``engine`` becomes `current`; the next ``lb.shutdown()`` closes and forgets it."""
    global _current
    _current = engine
    on_shutdown(_forget_current)


def release(engine: PSEngine) -> None:
    """A closed ``engine`` stops being `current`."""
    global _current
    if _current is engine:
        _current = None


def _forget_current() -> None:
    """At ``lb.shutdown()``: close the current engine (if any) and forget it."""
    global _current
    engine, _current = _current, None
    if engine is not None:
        engine.close()


def current() -> PSEngine:
    """The engine of the last ``distribute`` in this process (the one accessor of it; closing
    the engine or ``lb.shutdown()`` forgets it)."""
    if _current is None:
        raise RuntimeError("no parameter-server engine: call lb.distribute with mode='ps' first")
    return _current
