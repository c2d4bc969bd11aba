"""Handles of in-flight collectives, and the one rule for reading what they produce.

A handle is what an ``AllreduceFn`` returns: torch's ``Work`` (Gloo, NCCL), a
:class:`FutureHandle`, or ``Done``. The rule every wrapper keeps: **``wait()`` on a handle makes
the caller's current stream wait for the collective's device work** (and blocks the host only
for work that runs on the host, like Gloo's or a worker thread's). Readers call
:func:`wait_for`, the one place that turns a handle into "what follows may read the result".

The rule holds for NCCL's ``Work`` (its ``wait()`` queues an event wait on the current stream)
and for a torch ``Future`` that carries the work's device events: the backend's own future, a
future derived from it with ``then()`` (its callback runs on a stream that waited for those
events, and the derived future records its own on that stream), or a device future completed
on a stream that has waited for the work (`longboat.comm.streams`). A fresh ``Future()``
completed from a host callback carries no events: its ``wait()`` orders nothing on the device,
so it never stands for device work here. NCCL completes its futures on the host as soon as the
kernel is queued: a wrapper that hid NCCL's future behind a fresh one would let the optimizer
read gradients the allreduce is still summing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.futures import Future

from longboat.comm.algorithms import Handle
from longboat.comm.streams import sync_for


class FutureHandle:
    """A Handle over a torch Future: ``wait()`` for the result, ``get_future()`` to chain."""

    __slots__ = ("_future",)

    def __init__(self, future: Future):
        self._future = future

    def wait(self) -> object:
        return self._future.wait()

    def get_future(self) -> Future:
        return self._future

    def done(self) -> bool:
        return self._future.done()


def future_of(handle: Any) -> Future | None:
    """``handle``'s own future (never a new one): a Future itself, or ``get_future()``;
    None for a handle without one (``Done``, an algorithm that only has ``wait()``)."""
    if isinstance(handle, Future):
        return handle
    get_future = getattr(handle, "get_future", None)
    if get_future is None:
        return None
    try:
        return get_future()
    except RuntimeError:  # a backend's work without future support
        return None


def completed(tensor: torch.Tensor) -> Future:
    """A future already holding ``tensor``, for work that has finished as far as the caller's
    stream is concerned (after ``wait_for``): on a GPU it records the current stream's event,
    so whoever waits on it is ordered after everything queued there so far."""
    sync = sync_for(tensor.device)  # the device types that order streams, as everywhere
    future: Future = sync.future(tensor.device) if sync is not None else Future()
    future.set_result(tensor)
    return future


def wait_for(handle: Handle) -> object:
    """Order what the caller does next after ``handle``'s collective: the current stream
    waits for its device work, the host for its host work. Every reader of a collective's
    result goes through here."""
    return handle.wait()


class _ThenHandle:
    """Handle for an inner handle without a future: ``then`` runs inside ``wait()``."""

    def __init__(self, inner: Handle, then: Callable[[], torch.Tensor]):
        self._inner = inner
        self._then: Callable[[], torch.Tensor] | None = then
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor | None:
        if self._then is not None:
            wait_for(self._inner)
            self._result = self._then()
            self._then = None
        return self._result


def chain(inner: Handle, then: Callable[[], torch.Tensor]) -> Handle:
    """A handle that runs ``then`` after ``inner`` completes, without blocking the caller.

    With a future, ``then`` runs as a ``then()`` callback of ``inner``'s own future, so the
    returned handle carries ``inner``'s device events; ``then`` must return the tensor it
    wrote (its storage tells the derived future which devices to record events on). Without
    a future ``then`` runs inside ``wait()``.
    """
    future = future_of(inner)
    if future is None:
        return _ThenHandle(inner, then)

    def callback(done: Future) -> torch.Tensor:
        done.wait()  # re-raises the inner allreduce's error into the chained future
        return then()

    return FutureHandle(future.then(callback))
