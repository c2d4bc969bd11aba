"""What the model, reducer and optimizer report while training: one object, two consumers.

The `Observer` feeds the timeline `Recorder` (when ``Strategy.timeline`` is set) and the
`StallWatch` (when ``stall_warning_seconds`` > 0). With both off, ``lb.distribute`` installs
no observer and the hooks cost one ``is not None`` check each.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing.util
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from longboat.cluster import on_shutdown
from longboat.comm.handles import future_of
from longboat.optim.staged import Stage, StagedOptimizer, StageKind, StepRest
from longboat.trace.config import TraceConfig, TraceFields
from longboat.trace.recorder import Recorder, comm_lane
from longboat.trace.stall import StallWatch


class Observed(Protocol):
    """What `attach` reads of the model (``longboat.collective.model.DistributedModel``): its
    reducer (buckets, the observer slot), its plan (communicators, label) and its module."""

    reducer: Any
    plan: Any
    module: torch.nn.Module


class Recording(Protocol):
    """What `data` and `save` use of the current observer (`Observer`, or a PS trainer's)."""

    @property
    def recorder(self) -> Recorder | None: ...

    def close(self) -> None: ...


@dataclass
class _Session:
    """The trace's per-process state between `lb.init` and `lb.shutdown`."""

    current: Recording | None = None  # the last one installed: lb.trace.data() records into it
    serial: Iterator[int] = field(default_factory=itertools.count)  # lb.distribute calls


_session: _Session | None = None

_RECORD_WAIT_S = 2.0
"""At close, how long finished allreduces may take to reach the timeline (their callbacks run
on the thread that completed them); one that never finishes is not waited for longer."""


def _state() -> _Session:
    """The trace's state, created on first use; the next `lb.shutdown` forgets it."""
    global _session
    if _session is None:
        _session = _Session()
        on_shutdown(_forget)
    return _session


def _forget() -> None:
    global _session
    _session = None


def current_observer() -> Recording | None:
    """The observer that `data` records into and `save` finishes: the last one installed (by
    ``lb.distribute`` or a PS trainer), or None before that and after ``lb.shutdown``."""
    return _session.current if _session is not None else None


def make_current(observer: Recording) -> None:
    """``observer`` is the one `data` records into from now on."""
    _state().current = observer


def release(observer: Recording) -> None:
    """``observer`` is finished: if it is the current one, none is current any more."""
    if _session is not None and _session.current is observer:
        _session.current = None


class Observer:
    """Timeline recording and stall watching for one distributed model."""

    def __init__(
        self,
        recorder: Recorder | None,
        watch: StallWatch | None,
        algorithm: str,
    ):
        self.recorder = recorder
        self.watch = watch
        self.algorithm = algorithm
        self.step = 0
        self._forward_start = 0.0
        self._backward_start: float | None = None
        self._backward_end = 0.0
        self._lane_free: dict[int, float] = {}  # communicator -> when its last allreduce ended
        self._unrecorded = 0  # allreduces whose completion is not yet in the timeline
        self._recorded = threading.Condition()

    # -- DistributedModel.forward -------------------------------------------------------------

    def forward_begin(self) -> None:
        self.step += 1
        if self.recorder is not None:
            self._forward_start = self.recorder.now()
            self._backward_start = None

    def forward_end(self, output: Any) -> None:
        rec = self.recorder
        if rec is None:
            return
        rec.complete("compute", "forward", self._forward_start, rec.now(), args={"step": self.step})
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._backward_began)
                break

    def _backward_began(self, grad: torch.Tensor) -> None:
        if self._backward_start is None and self.recorder is not None:
            self._backward_start = self.recorder.now()

    # -- Reducer --------------------------------------------------------------------------------

    def bucket_ready(self, bucket: int) -> None:
        if self.recorder is not None:
            self.recorder.instant("compute", f"bucket {bucket} ready", {"bucket": bucket})

    def launched(self, bucket: int, comm: int, tensor: torch.Tensor, handle: Any) -> Any:
        """A bucket's allreduce started on communicator ``comm``; returns the handle to keep."""
        if self.watch is not None:
            self.watch.launched(bucket, handle)
        rec = self.recorder
        if rec is None:
            return handle
        future = future_of(handle)
        if future is None:
            return handle
        launched = rec.now()
        args = {
            "bucket": bucket,
            "bytes": tensor.numel() * tensor.element_size(),
            "algorithm": self.algorithm,
            "step": self.step,
        }

        def done(_: Any) -> None:
            end = rec.now()
            start = max(launched, self._lane_free.get(comm, launched))  # in order per comm
            self._lane_free[comm] = end
            rec.complete(comm_lane(comm), f"allreduce b{bucket}", start, end, "comm", args)
            with self._recorded:
                self._unrecorded -= 1
                self._recorded.notify_all()

        with self._recorded:
            self._unrecorded += 1
        future.add_done_callback(done)  # runs on the thread that completes it, maybe later
        return handle

    def backward_end(self) -> None:
        """The autograd engine finished backward; the reducer now waits for its allreduces."""
        if self.watch is not None:
            self.watch.begin_wait()
        rec = self.recorder
        if rec is not None:
            self._backward_end = rec.now()
            start = self._backward_start or self._backward_end
            rec.complete("compute", "backward", start, self._backward_end, args={"step": self.step})

    def synced(self) -> None:
        """Every allreduce of this backward finished (or failed)."""
        if self.watch is not None:
            self.watch.end_wait()
        rec = self.recorder
        if rec is not None:
            rec.complete("compute", "wait allreduce", self._backward_end, rec.now(), "wait")

    # -- optimizer, data ----------------------------------------------------------------------

    @contextlib.contextmanager
    def optimizer_step(self) -> Iterator[None]:
        if self.recorder is None:
            yield
            return
        with self.recorder.span("optimizer", "optimizer step", "optimizer", step=self.step):
            yield

    def close(self) -> None:
        """Stop the stall thread and finish the timeline file (idempotent)."""
        if self.watch is not None:
            self.watch.close()
        if self.recorder is not None:
            with self._recorded:  # a finished allreduce's callback may still be on its way
                self._recorded.wait_for(lambda: self._unrecorded <= 0, timeout=_RECORD_WAIT_S)
            self.recorder.save()


class RecordStep(Stage):
    """The optimizer stage that records the whole step on the optimizer lane."""

    kind = StageKind.TIMELINE

    def __init__(self, observer: Observer) -> None:
        self.observer = observer

    def step(self, rest: StepRest, closure: Any = None, **kwargs: Any) -> Any:
        with self.observer.optimizer_step():
            return rest(closure, **kwargs)


def attach(
    model: Observed,
    optimizer: torch.optim.Optimizer | None,
    config: TraceConfig | TraceFields,
) -> Any:
    """Install an observer on ``model`` (a DistributedModel) as ``config`` (a `TraceConfig`,
    or a Strategy) asks; returns the optimizer. When the timeline is on, a `StagedOptimizer`
    (what ``lb.distribute`` returns) gets a `RecordStep` stage, replacing one an earlier
    attach gave it (a rebuild); any other optimizer is returned as it is.

    The observer is closed (stall thread stopped, timeline finished) at the next
    ``lb.shutdown``, before the process group goes, or else at exit.
    """
    config = TraceConfig.of(config)
    timeline = config.timeline
    warning = config.stall_warning_seconds
    serial = next(_state().serial)  # in the same order on every rank
    name_sync_batchnorms(getattr(model, "module", model))
    if not timeline and warning <= 0:
        return optimizer
    rank, world = dist.get_rank(), dist.get_world_size()
    reducer = model.reducer
    plan = model.plan  # longboat.collective.plan.CollectivePlan: communicators, algorithm
    recorder = Recorder(timeline, rank, world, plan.comm.communicators) if timeline else None
    watch = None
    if warning > 0 and world > 1:
        watch = StallWatch(
            dist.distributed_c10d._get_default_store(),
            str(serial),
            rank,
            world,
            reducer.bucket_members(),
            warning,
            config.stall_shutdown_seconds,
        )
    if recorder is None and watch is None:
        return optimizer
    observer = Observer(recorder, watch, plan.label)
    reducer.observer = observer
    make_current(observer)
    on_shutdown(observer.close)
    # run at exit, also in multiprocessing children (which skip atexit handlers)
    multiprocessing.util.Finalize(observer, observer.close, exitpriority=20)
    if recorder is not None and isinstance(optimizer, StagedOptimizer):
        optimizer.set_stage(RecordStep(observer))
    return optimizer


def name_sync_batchnorms(module: torch.nn.Module) -> None:
    """Name each SyncBatchNorm's allreduces after its layer for the stall inspector
    ("sync BN statistics of layer1.0.bn1")."""
    for name, m in module.named_modules():
        if getattr(type(m), "stall_names", None) is not None:
            label = name or type(m).__name__
            m.stall_names = (
                f"sync BN statistics of {label}",
                f"sync BN gradient statistics of {label}",
            )


def data(loader: Iterable[Any], name: str = "next batch") -> Iterator[Any]:
    """Iterate ``loader``, recording each wait for the next batch on the ``data`` lane.

    With no timeline recording, batches pass straight through.
    """
    it = iter(loader)
    while True:
        current = current_observer()
        rec = current.recorder if current is not None else None
        start = rec.now() if rec is not None else 0.0
        try:
            batch = next(it)
        except StopIteration:
            return
        if rec is not None:
            rec.complete("data", name, start, rec.now(), "data")
        yield batch


def save() -> None:
    """Finish the timeline now (normally done at exit): the rank's last events are written and
    its file closed; rank 0 merges. Events recorded afterwards are dropped."""
    current = current_observer()
    if current is not None:
        current.close()
