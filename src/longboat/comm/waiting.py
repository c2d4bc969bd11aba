"""Waiting for a collective, with a way out when waiting has become hopeless.

A collective whose peer vanished (its machine lost power, its link was cut) blocks until the
backend's timeout: no connection-close ever arrives. In an elastic job the launchers notice the
silent node within about a second and publish a round without it, so the elastic layer
installs an `interrupt` check: `wait` then waits in slices and, between slices, raises what the
check returns. Gloo cannot cancel the abandoned collective; it stays referenced in
`abandoned()` (dropping the last reference, or destroying its process group, would block until
the backend's timeout) and fails on its own later.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from torch.futures import Future

#: Returns the exception to raise instead of waiting on (None: keep waiting).
Interrupt = Callable[[], BaseException | None]

SLICE_S = 0.25

_interrupt: Interrupt | None = None
_abandoned: list[Any] = []


def set_interrupt(check: Interrupt | None) -> None:
    """Install (or with None remove) the check `wait` runs between slices."""
    global _interrupt
    _interrupt = check


def abandoned() -> list[Any]:
    """Collectives `wait` gave up on (kept referenced; see the module docstring)."""
    return _abandoned


def wait(handle: Any) -> None:
    """``handle.wait()``, leaving early with the interrupt's exception when one is installed
    and the handle offers a future to wait on in slices."""
    check = _interrupt
    future = _future_of(handle) if check is not None else None
    if future is None:
        handle.wait()
        return
    finished = threading.Event()
    future.add_done_callback(lambda _: finished.set())
    while not finished.wait(SLICE_S):
        reason = check() if check is not None else None
        if reason is not None:
            _abandoned.append(handle)
            raise reason
    handle.wait()  # done: returns, or raises the collective's own error


def _future_of(handle: Any) -> Future | None:
    if isinstance(handle, Future):
        return handle
    get_future = getattr(handle, "get_future", None)
    if get_future is None:
        return None
    try:
        return get_future()
    except RuntimeError:  # a backend or work type without futures
        return None
