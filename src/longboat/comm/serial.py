"""At most one collective in flight per communicator, without blocking the caller.

Fleet's ``sync_nccl_allreduce``: each communicator finishes its previous allreduce before it
starts the next. Blocking the backward thread on the previous allreduce would stall
computation, so the next launch is chained onto the previous one's completion instead: the
caller gets a future at once and backward keeps running.
"""

from __future__ import annotations

import torch
from torch.futures import Future

from longboat.comm.algorithms import AllreduceFn, Done, Handle


def _future_of(handle: Handle) -> Future:
    if isinstance(handle, Future):
        return handle
    if isinstance(handle, Done):
        done: Future = Future()
        done.set_result(None)
        return done
    get_future = getattr(handle, "get_future", None)
    if get_future is not None:
        return get_future()
    handle.wait()  # an algorithm without futures: complete it here
    finished: Future = Future()
    finished.set_result(None)
    return finished


def _settle(result: Future, source: Future) -> None:
    try:
        source.value()
    except BaseException as exc:  # noqa: BLE001 - forwarded to whoever waits on result
        result.set_exception(exc)
    else:
        result.set_result(None)


class SerialAllreduce:
    """Wraps an AllreduceFn so its collectives run one after another, asynchronously."""

    def __init__(self, fn: AllreduceFn):
        self._fn = fn
        self._tail: Future | None = None

    def __call__(self, tensor: torch.Tensor, fn: AllreduceFn | None = None) -> Future:
        """Start ``fn(tensor)`` (default: the wrapped allreduce) after the previous one."""
        result: Future = Future()
        run = fn or self._fn

        def start(_: object = None) -> None:
            try:
                source = _future_of(run(tensor))
            except BaseException as exc:  # noqa: BLE001
                result.set_exception(exc)
                return
            source.add_done_callback(lambda f: _settle(result, f))

        previous, self._tail = self._tail, result
        if previous is None:
            start()
        else:
            previous.add_done_callback(start)  # runs at once if previous already finished
        return result
