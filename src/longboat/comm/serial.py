"""At most one collective in flight per communicator, without blocking the caller.

Fleet's ``sync_nccl_allreduce``: each communicator finishes its previous allreduce before it
starts the next.

* **On a device** (NCCL, or a GPU bucket handed to an algorithm or compressor written in
  Python) this already holds where the work runs: a communicator's collectives queue on its
  one stream, and Python algorithms run in call order on one worker thread. The handle passes
  through untouched, so it keeps the work's device events (`longboat.comm.handles`); hiding
  it behind a host-completed future would let readers run ahead of the reduction.
* **On the CPU** (Gloo runs collectives on a pool of threads), the next launch is chained onto
  the previous one's completion instead: blocking the backward thread on the previous
  allreduce would stall computation, so the caller gets a future at once and backward keeps
  running. On the CPU a future completed by the host is the work being done.
"""

from __future__ import annotations

import torch
from torch.futures import Future

from longboat.comm.algorithms import AllreduceFn, Handle
from longboat.comm.handles import future_of


def _host_future(handle: Handle) -> Future:
    """A future that completes when ``handle``'s host work has (CPU tensors only)."""
    future = future_of(handle)
    if future is not None:
        return future
    handle.wait()  # Done, or an algorithm without futures: it has finished once this returns
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

    def __call__(self, tensor: torch.Tensor, fn: AllreduceFn | None = None) -> Handle:
        """Start ``fn(tensor)`` (default: the wrapped allreduce) after the previous one."""
        run = fn or self._fn
        if tensor.device.type != "cpu":
            return run(tensor)  # ordered where it runs; its handle carries its events
        result: Future = Future()  # CPU tensors only: host completion is the work done

        def start(_: object = None) -> None:
            try:
                source = _host_future(run(tensor))
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
