"""Every wrapper's handle keeps the device ordering of the collective it stands for.

On a GPU, NCCL completes a collective's future on the host as soon as the kernel is queued;
only the events that future carries order a reader after the reduction. So no wrapper may
hide the source future behind a fresh one. Checked here without a GPU: tensors on the meta
device take the device paths, the source future is a sentinel type whose ``then`` records its
lineage, and a recording :class:`~longboat.comm.streams.DeviceSync` stands in for CUDA's
events and streams.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import pytest
import torch
from torch.futures import Future

from longboat.comm import streams
from longboat.comm.background import AsyncAllreduce
from longboat.comm.compress import ThreadedCompressor, make_compressor
from longboat.comm.handles import FutureHandle, chain, future_of, wait_for
from longboat.comm.serial import SerialAllreduce


class SentinelFuture(Future):
    """A device future stand-in: ``then`` derives a child that remembers its parent."""

    def __init__(self, parent: SentinelFuture | None = None):
        super().__init__()
        self.parent = parent

    def then(self, callback):  # noqa: ANN001, ANN201 - torch's signature
        child = SentinelFuture(parent=self)
        child.set_result(callback(self))  # the source is complete: run at once, as torch does
        return child

    def descends_from(self, ancestor: Future) -> bool:
        node: SentinelFuture | None = self
        while node is not None:
            if node is ancestor:
                return True
            node = node.parent
        return False


class DeviceWork:
    """An NCCL-like work: complete on the host at once; its future is all that orders."""

    def __init__(self) -> None:
        self.future = SentinelFuture()
        self.future.set_result(None)

    def wait(self) -> bool:
        return True

    def get_future(self) -> SentinelFuture:
        return self.future


class DeviceAllreduce:
    """An AllreduceFn over meta tensors that hands out :class:`DeviceWork` and keeps them."""

    def __init__(self) -> None:
        self.works: list[DeviceWork] = []

    def __call__(self, tensor: torch.Tensor) -> DeviceWork:
        self.works.append(DeviceWork())
        return self.works[-1]


class _Group:
    def size(self) -> int:
        return 2


def _bucket() -> torch.Tensor:
    return torch.empty(64, device="meta")


def _descends(handle: object, work: DeviceWork) -> bool:
    future = future_of(handle)
    return isinstance(future, SentinelFuture) and future.descends_from(work.future)


def test_serial_passes_a_device_handle_through():
    inner = DeviceAllreduce()
    serial = SerialAllreduce(inner)
    first, second = serial(_bucket()), serial(_bucket())
    assert _descends(first, inner.works[0]) and _descends(second, inner.works[1])


def test_serial_over_a_cast_keeps_the_source_lineage():
    """The default path's shape: SerialAllreduce over the bucket compressor over native."""
    for name in ("none", "fp16", "bf16"):
        inner = DeviceAllreduce()
        serial = SerialAllreduce(make_compressor(name, inner, _Group()))  # type: ignore[arg-type]
        handle = serial(_bucket())
        assert _descends(handle, inner.works[-1]), name


def test_serial_keeps_the_flags_chain_on_a_device():
    """The used-parameter flags join a communicator's chain through ``fn=``."""
    inner, flags = DeviceAllreduce(), DeviceAllreduce()
    serial = SerialAllreduce(inner)
    serial(_bucket())
    handle = functools.partial(serial, fn=flags)(_bucket())
    assert _descends(handle, flags.works[-1])


def test_chain_derives_from_the_source_future():
    work = DeviceWork()
    handle = chain(work, lambda: torch.empty(1, device="meta"))
    assert isinstance(handle, FutureHandle) and _descends(handle, work)


def test_serial_still_orders_cpu_collectives_on_the_host():
    """On the CPU the next allreduce starts only once the previous one finished."""
    started: list[int] = []
    pending: list[Future] = []

    def slow(tensor: torch.Tensor) -> FutureHandle:
        started.append(len(started))
        pending.append(Future())
        return FutureHandle(pending[-1])

    serial = SerialAllreduce(slow)
    first, second = serial(torch.zeros(2)), serial(torch.zeros(2))
    assert started == [0]
    pending[0].set_result(None)
    wait_for(first)
    assert started == [0, 1]
    pending[1].set_result(None)
    wait_for(second)


# -- work handed to a worker thread --------------------------------------------------------------


class RecordingSync:
    """A DeviceSync for the meta device that records the order of the hand-off."""

    def __init__(self) -> None:
        self.log: list[tuple[str, object]] = []
        self.inside = False
        self.lock = threading.Lock()
        self.futures: list[_RecordedFuture] = []

    def mark(self, device: torch.device) -> str:
        self.log.append(("mark", threading.get_ident()))
        return f"mark{len(self.log)}"

    def side_stream(self, device: torch.device) -> str:
        return "side"

    @contextlib.contextmanager
    def enter(self, stream: object, mark: object) -> Iterator[None]:
        self.log.append(("enter", mark))
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    def future(self, device: torch.device) -> Future:
        future = _RecordedFuture(self)
        self.futures.append(future)
        return future


class _RecordedFuture(Future):
    def __init__(self, sync: RecordingSync):
        super().__init__()
        self.sync = sync
        self.completed_inside: bool | None = None
        self.waited_by: set[int] = set()  # threads whose stream waited for it

    def set_result(self, result: object) -> None:
        self.completed_inside = self.sync.inside
        super().set_result(result)

    def wait(self) -> object:
        self.waited_by.add(threading.get_ident())
        return super().wait()


@pytest.fixture
def meta_sync(monkeypatch: pytest.MonkeyPatch) -> RecordingSync:
    sync = RecordingSync()
    monkeypatch.setitem(streams.SYNCS, "meta", sync)
    return sync


class _Passthrough:
    """A blocking compressor core: waits for its inner allreduce, as DGC and PowerSGD do."""

    def __init__(self, inner: DeviceAllreduce):
        self.inner = inner
        self.stats = None
        self.world_size = 2
        self.waited: list[bool] = []

    def __call__(self, tensor: torch.Tensor) -> None:
        wait_for(self.inner(tensor))

    def set_layout(self, bucket: torch.Tensor, layout: object) -> None: ...

    def residual(self, tensor: torch.Tensor) -> None:
        return None


def test_worker_thread_work_is_ordered_on_both_sides(meta_sync: RecordingSync):
    """A threaded compressor on a device: the worker waits for the caller's stream position
    and completes a device future on its own stream."""
    compressor = ThreadedCompressor(_Passthrough(DeviceAllreduce()), "test")  # type: ignore[arg-type]
    try:
        handle = compressor(_bucket())
        wait_for(handle)
        future = future_of(handle)
        assert isinstance(future, _RecordedFuture)  # the device's future, not a bare one
        assert future.completed_inside is True  # completed on the worker's stream
        (kind, caller), (entered, mark) = meta_sync.log
        assert (kind, caller) == ("mark", threading.get_ident())  # taken by the caller
        assert entered == "enter" and mark == "mark1"  # the worker waited for that mark
    finally:
        compressor.close()


def test_async_algorithms_hand_off_the_same_way(meta_sync: RecordingSync):
    ran: list[bool] = []
    algorithm = AsyncAllreduce(lambda t: ran.append(meta_sync.inside), "test")
    try:
        future = future_of(algorithm(_bucket()))
        assert future is not None
        future.wait()
        assert ran == [True] and isinstance(future, _RecordedFuture)
        assert future.completed_inside is True
    finally:
        algorithm.close()


def test_cpu_work_needs_no_device_sync():
    algorithm = AsyncAllreduce(lambda t: t.add_(1), "test")
    try:
        tensor = torch.zeros(3)
        wait_for(algorithm(tensor))
        assert torch.equal(tensor, torch.ones(3))
    finally:
        algorithm.close()
