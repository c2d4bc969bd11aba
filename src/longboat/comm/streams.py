"""Device work handed from the caller's stream to a worker thread's, and back as a future.

Algorithms and compressors written in Python run their collectives on a worker thread
(`longboat.comm.background`). On a GPU the worker must not read a bucket before the kernels
that packed it on the caller's stream have run, and whoever waits on the worker's future must
wait for the kernels the worker queued, not merely for the worker to return on the host. So:

* at submission, the caller's current stream records an event (:meth:`DeviceSync.mark`; the
  host does not wait);
* the worker runs on a side stream of its own that first waits for that event
  (:meth:`DeviceSync.enter`);
* the work's future is a device future (:meth:`DeviceSync.future`), completed on the side stream
  with the tensor it wrote: it records the side stream's event, and its ``wait()`` makes the
  waiter's current stream wait for it (`longboat.comm.handles`).

CPU tensors need none of this: the host finishing the work is the work being finished.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch.futures import Future


class DeviceSync(Protocol):
    """How one device type orders work between streams."""

    def mark(self, device: torch.device) -> Any:
        """Record where the caller's current stream on ``device`` is now (no host wait)."""

    def side_stream(self, device: torch.device) -> Any:
        """A new stream on ``device`` for a worker thread."""

    def enter(self, stream: Any, mark: Any) -> contextlib.AbstractContextManager:
        """Make ``stream`` wait for ``mark`` and make it (and its device) current."""

    def future(self, device: torch.device) -> Future:
        """A future that records device events on the current stream when completed."""


class CudaSync:
    """:class:`DeviceSync` for CUDA: events, pool-free side streams, device futures."""

    def mark(self, device: torch.device) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.Stream(device)

    @contextlib.contextmanager
    def enter(self, stream: torch.cuda.Stream, mark: torch.cuda.Event) -> Iterator[None]:
        stream.wait_event(mark)
        with torch.cuda.device(stream.device), torch.cuda.stream(stream):
            yield

    def future(self, device: torch.device) -> Future:
        return Future(devices=[device])


#: device type -> how it orders streams; a device type not listed runs on the host (CPU)
SYNCS: dict[str, DeviceSync] = {"cuda": CudaSync()}


def sync_for(device: torch.device) -> DeviceSync | None:
    """How ``device`` orders streams, or None where work completes on the host."""
    return SYNCS.get(device.type)


class Handoff:
    """One piece of work handed to a worker: the caller's stream position and the future."""

    __slots__ = ("device", "future", "mark", "sync")

    def __init__(self, tensor: torch.Tensor):
        self.device = tensor.device
        self.sync = sync_for(tensor.device)
        self.mark = self.sync.mark(tensor.device) if self.sync is not None else None
        self.future: Future = (
            self.sync.future(tensor.device) if self.sync is not None else Future()
        )


class WorkerStreams:
    """A worker thread's side streams, one per device, made on first use (worker side)."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}

    @contextlib.contextmanager
    def running(self, handoff: Handoff) -> Iterator[None]:
        """Run the body after the caller's stream position, on this worker's stream."""
        if handoff.sync is None:
            yield
            return
        stream = self._streams.get(handoff.device)
        if stream is None:
            stream = self._streams[handoff.device] = handoff.sync.side_stream(handoff.device)
        with handoff.sync.enter(stream, handoff.mark):
            yield
