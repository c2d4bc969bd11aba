"""The engine of the last ``distribute`` in this process (``lb.ps.current()``); closing it or
``lb.shutdown()`` forgets it. Its own module so that what reaches the engine through it
(``table_admin``, ``lb.ps.save``) needs no import of ``engine``: it holds an `ActiveEngine`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from longboat.cluster import on_shutdown

if TYPE_CHECKING:
    from longboat.ps.trainer.client import Client


class ActiveEngine(Protocol):
    """What is read of the current engine (a ``PSEngine``) through `current`."""

    @property
    def client(self) -> Client: ...

    def shrink(self, tables: list[str] | None = None) -> dict[str, int]: ...

    def save(self) -> int: ...

    def close(self) -> None: ...


_current: ActiveEngine | None = None  # read through current(); forgotten at lb.shutdown()


def make_current(engine: ActiveEngine) -> None:
    """``engine`` becomes `current`; the next ``lb.shutdown()`` closes and forgets it."""
    global _current
    _current = engine
    on_shutdown(_forget_current)


def release(engine: ActiveEngine) -> None:
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


def current() -> ActiveEngine:
    """The engine of the last ``distribute`` in this process (the one accessor of it; closing
    the engine or ``lb.shutdown()`` forgets it)."""
    if _current is None:
        raise RuntimeError("no parameter-server engine: call lb.distribute with mode='ps' first")
    return _current
