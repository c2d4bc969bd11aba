"""Run a blocking collective on a background thread, in order, handing out futures.

Algorithms written in Python (ring over point-to-point messages, shared memory) block the
thread that runs them. Wrapped here, they behave like the backend's asynchronous collectives:
the caller (a gradient hook during backward) gets a future at once, the work runs on one
worker thread in submission order (so every rank runs its collectives in the same order),
and torch's kernels and socket waits release the GIL, so backward keeps computing.

On a GPU the worker runs on a side stream that waits for the caller's stream at submission,
and the future it completes carries that stream's event (`longboat.comm.streams`): a waiter's
stream is ordered after the work, not merely after the worker returned on the host.

A worker belongs to the process group it was built on: ``lb.shutdown()`` destroying the group
``lb.init`` created (an elastic world change included) stops it, as the interpreter's exit
does.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

import torch
from torch.futures import Future

from longboat.cluster.runtime import on_group_end
from longboat.comm.handles import FutureHandle
from longboat.comm.streams import Handoff, WorkerStreams

_STOP = object()
#: a worker still alive when the interpreter exits aborts the process ("terminate called
#: without an active exception"): every live one is stopped at exit, whoever forgot to, and
#: when ``lb.shutdown()`` destroys the process group it ran on; one stuck in a collective with
#: a peer that never joins is left behind after this long
_EXIT_JOIN_S = 5.0
_LIVE: weakref.WeakSet[BackgroundAllreduce] = weakref.WeakSet()


def _stop_all() -> None:
    for worker in list(_LIVE):
        worker.close(timeout=_EXIT_JOIN_S)


atexit.register(_stop_all)


class BackgroundAllreduce:
    """``fn(tensor)`` (in-place, blocking) turned into an asynchronous AllreduceFn."""

    def __init__(self, fn: Callable[[torch.Tensor], None], name: str):
        self._fn = fn
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"longboat-{name}", daemon=True)
        self._thread.start()
        _LIVE.add(self)
        on_group_end(self._stop_at_shutdown)

    def __call__(
        self, tensor: torch.Tensor, fn: Callable[[torch.Tensor], None] | None = None
    ) -> Future:
        """Queue ``fn(tensor)`` (default: this allreduce's ``fn``) behind earlier calls."""
        handoff = Handoff(tensor)
        self._queue.put((tensor, fn or self._fn, handoff))
        return handoff.future

    @property
    def closed(self) -> bool:
        """True once `close` was called (also by ``lb.shutdown``): nothing more may be queued."""
        return self not in _LIVE

    def close(self, timeout: float | None = None) -> None:
        """Finish queued work, then stop the worker thread (waiting at most ``timeout`` s: a
        worker stuck in a collective with a dead peer is left behind). Safe to call twice."""
        _LIVE.discard(self)
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout)

    def _stop_at_shutdown(self) -> None:
        self.close(timeout=_EXIT_JOIN_S)

    def _run(self) -> None:
        streams = WorkerStreams()
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            tensor, fn, handoff = item
            try:
                with streams.running(handoff):  # the future records this stream's event
                    fn(tensor)
                    handoff.future.set_result(tensor)
            except BaseException as exc:  # noqa: BLE001 - delivered to the waiter
                if not handoff.future.done():
                    handoff.future.set_exception(exc)
            finally:  # hold nothing of this job while waiting for the next (a full bucket)
                del item, tensor, fn, handoff


State = TypeVar("State", bound=Callable[[torch.Tensor], None])


class AsyncAllreduce(Generic[State]):
    """A blocking in-place algorithm ``state(tensor)`` run in order on a worker thread.

    ``state`` stays reachable (e.g. for byte counters) as ``.state``; ``check(tensor)``, if
    given, runs in the caller's thread so that a bad argument raises at the call.
    """

    def __init__(
        self, state: State, name: str, check: Callable[[torch.Tensor], None] | None = None
    ):
        self.state = state
        self._check = check
        self._background = BackgroundAllreduce(state, name)

    def __call__(self, tensor: torch.Tensor) -> FutureHandle:
        if self._check is not None:
            self._check(tensor)
        return FutureHandle(self._background(tensor))

    def submit(self, fn: Callable[[torch.Tensor], None], tensor: torch.Tensor) -> FutureHandle:
        """Run another blocking ``fn(tensor)`` in the same order as the allreduces."""
        return FutureHandle(self._background(tensor, fn))

    def close(self) -> None:
        """Finish queued allreduces, then stop the worker thread."""
        self._background.close()
