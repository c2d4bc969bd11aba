"""A collective backend for tests: N virtual ranks in one process, with NCCL's stream semantics.

One GPU at world size 1 is the one place where NCCL moves no data, so it cannot show a reader
that runs ahead of a reduction. This backend, registered from Python, can:

* **Its future completes when the collective is queued**, as NCCL's does: the host learns
  nothing from it. What it carries is a device event, and ``Work.wait()`` /
  ``future.wait()`` make the waiter's current stream wait for it, as NCCL's do.
* **The data moves later, on the backend's own stream**: at launch that stream waits for the
  caller's current stream (so it reads what the caller packed), sleeps for ``delay_cycles``
  (``torch.cuda._sleep``) and only then writes the result. A reader on the compute stream
  that was not made to wait reads the tensor as it was before the collective.
* **The result is what N ranks holding this rank's tensor would produce**: SUM multiplies by
  N, AVG, MAX and MIN keep the value, all-gather repeats it, broadcast keeps it. Buckets hold
  ``grad / N`` before the allreduce and ``grad`` after, so an early read is off by N and
  training drifts from the single-process reference on the same batch.
* ``poison(k)``: the next ``k`` floating-point SUM allreduces write ``inf`` into their first
  element after summing, as if another rank had overflowed: an overflow decision that reads
  before the reduction lands sees only this rank's finite gradients.

CPU tensors are reduced at once on the host (their futures complete with the data), so the
same harness checks its references on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

from longboat.cluster.backends import register_device_backend

NAME = "lagging"
#: about 10 ms on an H100 at 1.7 GHz: far longer than the kernels queued behind a collective
DEFAULT_DELAY_CYCLES = 20_000_000


@dataclass
class Settings:
    """Shared by every group of the backend in this process."""

    delay_cycles: int = DEFAULT_DELAY_CYCLES
    poisoned: int = 0  # floating SUM allreduces still to poison
    collectives: int = 0  # collectives queued so far (a test can check the harness used it)


SETTINGS = Settings()
_lock = threading.Lock()


def poison(count: int = 1) -> None:
    """Make the next ``count`` floating-point SUM allreduces produce ``inf`` (first element)."""
    with _lock:
        SETTINGS.poisoned = count


def _take_poison() -> bool:
    with _lock:
        if SETTINGS.poisoned <= 0:
            return False
        SETTINGS.poisoned -= 1
        return True


def _reduce(tensor: torch.Tensor, op: dist.ReduceOp, n: int, poisoned: bool) -> None:
    """``tensor`` becomes the reduction over ``n`` ranks that all hold it (in place)."""
    if op == dist.ReduceOp.SUM:
        tensor.mul_(n)
    elif op == dist.ReduceOp.PRODUCT:
        tensor.pow_(n)
    elif not any(op == kept for kept in (dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.MIN)):
        raise NotImplementedError(f"{NAME} backend: reduce op {op} is not emulated")
    if poisoned:
        tensor.view(-1)[:1].fill_(float("inf"))


class LaggingGroup(dist.ProcessGroup):
    """The process group: rank 0 of ``size`` virtual ranks (see the module docstring)."""

    def __init__(self, rank: int, size: int):
        super().__init__(rank, size)
        self._size = size
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return NAME

    def size(self) -> int:
        return self._size

    # -- the one place collectives run ---------------------------------------------------------

    @contextlib.contextmanager
    def _stream_for(self, device: torch.device) -> Iterator[None]:
        if device.type != "cuda":
            yield
            return
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # reads what the caller queued
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SETTINGS.delay_cycles)
            yield

    def _run(self, tensors: list[torch.Tensor], body: Callable[[], None]) -> dist.Work:
        """Queue ``body`` (which writes ``tensors``) the way NCCL would; its Work at once."""
        with _lock:
            SETTINGS.collectives += 1
        device = tensors[0].device if tensors else torch.device("cpu")
        with self._stream_for(device):
            body()
            if device.type == "cuda":
                stream = torch.cuda.current_stream(device)
                for t in tensors:
                    t.record_stream(stream)  # not reused before this stream has read it
                future: Future = Future(devices=[device])
            else:
                future = Future()
            future.set_result(tensors)  # on the backend stream: the event waiters wait for
        return _create_work_from_future(future)

    # -- collectives ----------------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:
        op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
        poisoned = op == dist.ReduceOp.SUM and any(t.is_floating_point() for t in tensors)
        poisoned = poisoned and _take_poison()

        def body() -> None:
            for t in tensors:
                _reduce(t, op, self._size, poisoned and t.is_floating_point())

        return self._run(tensors, body)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:
        return self._run(tensors, lambda: None)  # every virtual rank holds rank 0's values

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: object = None
    ) -> dist.Work:
        def body() -> None:
            for outs, source in zip(outputs, inputs, strict=True):
                for out in outs:
                    out.copy_(source)

        return self._run([t for outs in outputs for t in outs] + list(inputs), body)

    def all_gather_single(
        self, output: torch.Tensor, source: torch.Tensor, opts: object = None
    ) -> dist.Work:
        def body() -> None:
            for chunk in output.chunk(self._size):
                chunk.copy_(source.view_as(chunk))

        return self._run([output, source], body)

    _allgather_base = all_gather_single  # its name before torch 2.13

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: object = None
    ) -> dist.Work:
        op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)

        def body() -> None:
            for out, parts in zip(outputs, inputs, strict=True):
                out.copy_(parts[self.rank()])
                _reduce(out, op, self._size, False)

        return self._run(list(outputs) + [t for parts in inputs for t in parts], body)

    def reduce_scatter_single(
        self, output: torch.Tensor, source: torch.Tensor, opts: object = None
    ) -> dist.Work:
        op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)

        def body() -> None:
            output.copy_(source.chunk(self._size)[self.rank()].view_as(output))
            _reduce(output, op, self._size, False)

        return self._run([output, source], body)

    _reduce_scatter_base = reduce_scatter_single  # its name before torch 2.13

    def barrier(self, opts: object = None) -> dist.Work:
        return self._run([], lambda: None)


def _create(
    store: dist.Store, rank: int, size: int, timeout: object
) -> LaggingGroup:  # torch's creator signature
    return LaggingGroup(rank, size)


def register(on_device: bool) -> None:
    """Make ``init_process_group("lagging")`` available; ``on_device``: as a backend of NCCL's
    kind (longboat takes its GPU paths), else as a host backend like Gloo."""
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, _create, devices=["cpu", "cuda"])
    if on_device:
        register_device_backend(NAME)


def init(world_size: int, on_device: bool, delay_cycles: int = DEFAULT_DELAY_CYCLES) -> None:
    """Initialise the default process group: this process as rank 0 of ``world_size``."""
    register(on_device)
    SETTINGS.delay_cycles = delay_cycles
    SETTINGS.poisoned = 0
    dist.init_process_group(NAME, store=dist.HashStore(), rank=0, world_size=world_size)
