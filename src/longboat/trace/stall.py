"""Stall inspector: which ranks have not reached the collective this rank waits for.

Two watchers share one mechanism: each rank counts what it has started (an integer increment on
the hot path); a background thread publishes the latest count to the c10d store, at most once
per tick and only when it changed, so training never makes a store round trip. When this rank
has waited longer than ``stall_warning_seconds``, the same thread reads every rank's count and
logs, like Horovod::

    rank 0 has waited 2.0 s for the allreduce of bucket 0 (launch 7). Missing ranks:
    1: [net.2.weight, net.2.bias]

- `StallWatch` (one per ``lb.distribute``): the gradient allreduce buckets. A rank that launched
  fewer buckets than the one awaited has not produced those gradients yet. Launch ``m`` is mapped
  to its bucket through the bucket lists in use when it was launched (``Strategy(auto=True)``
  switches reducers, every rank at the same launch count).
- `CollectiveWatch` (one per process group): every other collective longboat issues on the world
  group, by name: the model check and ``broadcast of parameters`` in ``lb.distribute``,
  ``barrier``, ``local SGD averaging of bucket N``, ``sync BN statistics of <layer>``. Code runs
  them inside ``with waiting("name"):``; a rank whose count is below the awaited one is named
  with the last collective it reached.

Every process group longboat makes carries the job's timeout (``LONGBOAT_TIMEOUT``), so the
backend ends a wait that lasts that long; shortly before, the inspector logs its report as an
error, so the rank's last words name the missing ranks. After ``stall_shutdown_seconds`` (0: the
job timeout plus `TIMEOUT_GRACE_S`, for waits the backend does not end itself) the report is
logged as an error and the process exits with `STALL_EXIT_CODE`, which the launcher reports as
that rank's failure. Works on any backend: it needs only the store, not the backend's own
watchdog. Parameter-server replies are
watched by the trainer's client (``longboat.ps.trainer.client``) with the same thresholds and exit code.
"""

from __future__ import annotations

import contextlib
import multiprocessing.util
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from longboat.cluster import on_shutdown
from longboat.log import get_logger
from longboat.trace.config import TraceConfig

log = get_logger("longboat.stall")

#: exit status of a rank that the stall inspector shut down (EX_SOFTWARE)
STALL_EXIT_CODE = 70
#: seconds past the job timeout after which the inspector ends a wait the backend has not
TIMEOUT_GRACE_S = 3.0
_MAX_NAMES = 8
_NULL = contextlib.nullcontext()

Buckets = Sequence[Sequence[str]]
#: (launches before the first launch of this bucket list, the bucket list), oldest first
History = Sequence[tuple[int, Buckets]]


def job_timeout_s() -> float:
    """The job's timeout in seconds (``LONGBOAT_TIMEOUT``; see `longboat.cluster.job_timeout`)."""
    from longboat.cluster import job_timeout

    return job_timeout().total_seconds()


def finished(handle: Any) -> bool:
    """Whether a collective handle (Work, Future, FutureHandle, Done) has completed."""
    for attr in ("is_completed", "done"):
        probe = getattr(handle, attr, None)
        if probe is not None:
            try:
                return bool(probe())
            except Exception:  # noqa: BLE001 - a failed collective counts as finished
                return True
    return not hasattr(handle, "wait") or type(handle).__name__ == "Done"


def shown(names: Sequence[str]) -> str:
    """At most ``_MAX_NAMES`` names, comma-separated."""
    return ", ".join(names[:_MAX_NAMES]) + (", ..." if len(names) > _MAX_NAMES else "")


def bucket_of(launch: int, history: History) -> tuple[int, Buckets]:
    """(bucket index, bucket list) of the 1-based ``launch``: every synchronised backward
    launches buckets 0..n-1 in order, counted from the launch count where its list began."""
    base, buckets = history[0]
    for start, later in history[1:]:
        if launch > start:
            base, buckets = start, later
    return (launch - base - 1) % len(buckets), buckets


def missing_report(
    awaited: int,
    progress: dict[int, int | None],
    buckets: Buckets,
    history: History | None = None,
) -> str:
    """``Missing ranks: r: [names...]`` for the ranks whose launch count is below ``awaited``.

    ``awaited`` is the 1-based launch number this rank waits on; a rank that launched ``done``
    misses the tensors of launches ``done + 1 .. awaited`` (at most one step's worth is listed).
    ``history`` maps launches to bucket lists after reducer switches (default: ``buckets`` from
    launch 1 on).
    """
    history = history or [(0, buckets)]
    parts = []
    for rank, done in sorted(progress.items()):
        if done is None:
            parts.append(f"{rank}: [no progress published: not started, or dead]")
            continue
        if done >= awaited:
            continue
        span = len(bucket_of(awaited, history)[1])  # one step of the reducer awaited
        names: dict[str, None] = {}
        for launch in range(max(done + 1, awaited - span + 1), awaited + 1):
            index, lists = bucket_of(launch, history)
            names.update(dict.fromkeys(lists[index]))
        parts.append(f"{rank}: [{shown(list(names))}]")
    return "Missing ranks: " + ("; ".join(parts) if parts else "none (all arrived; slow network?)")


def abort(
    message: str,
    shutdown_s: float,
    exit_fn: Callable[[int], None] = os._exit,
    *,
    reason: str | None = None,
) -> None:
    """Log ``message`` as the reason for a stall shutdown and exit with `STALL_EXIT_CODE`.

    ``reason`` names the limit that was reached (default: ``stall_shutdown_seconds``).
    """
    why = reason or f"stall_shutdown_seconds={shutdown_s:g}"
    log.error("%s. Shutting down (%s): exit %d", message, why, STALL_EXIT_CODE)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    exit_fn(STALL_EXIT_CODE)


class _Watcher:
    """The thread that publishes this rank's count and inspects its current wait."""

    def __init__(
        self,
        store: dist.Store,
        prefix: str,
        rank: int,
        world_size: int,
        warning_s: float,
        shutdown_s: float,
        exit_fn: Callable[[int], None],
        timeout_s: float | None,
    ):
        self._store = dist.PrefixStore(prefix, store)
        self.rank = rank
        self.world_size = world_size
        self._exit = exit_fn
        self.wait_since: float | None = None
        self._published: Any = None
        self._warned_at: float | None = None
        self._inspected: float | None = None  # the wait_since of the wait last inspected
        self._reported = False  # whether this wait's report before the timeout was logged
        self.wait_timeout_s: float | None = None  # the current wait's own timeout, if it has one
        self.timeout_s = job_timeout_s() if timeout_s is None else timeout_s
        self.retune(warning_s, shutdown_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="longboat-stall", daemon=True)
        self._thread.start()

    def retune(self, warning_s: float, shutdown_s: float) -> None:
        """New thresholds (seconds; shutdown 0: at the job timeout plus `TIMEOUT_GRACE_S`)."""
        self.warning_s, self.shutdown_s = warning_s, shutdown_s
        self._tick = min(1.0, max(0.05, warning_s / 4))

    def _timeout(self) -> float:
        """The timeout of the current wait: its own (``waiting(..., timeout_s=)``) or the job's."""
        return self.timeout_s if self.wait_timeout_s is None else self.wait_timeout_s

    def limit(self) -> tuple[float, str]:
        """(seconds of waiting after which this rank shuts down, the setting that says so)."""
        timeout = self._timeout()
        if 0 < self.shutdown_s < timeout + TIMEOUT_GRACE_S:
            return self.shutdown_s, f"stall_shutdown_seconds={self.shutdown_s:g}"
        return timeout + TIMEOUT_GRACE_S, f"timeout of {timeout:g}s exceeded"

    def report_at(self) -> float:
        """Seconds of waiting after which the report is logged once as an error, ahead of the
        timeout at which the backend ends the wait."""
        timeout = self._timeout()
        return timeout - min(5.0, timeout / 5)

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout)

    def _value(self) -> Any:
        raise NotImplementedError

    def describe(self, waited: float) -> str:
        raise NotImplementedError

    def _alive(self) -> bool:
        """Whether there is still something to watch (the thread ends otherwise)."""
        return True

    def _run(self) -> None:
        while not self._stop.wait(self._tick) and self._alive():
            try:
                self._publish()
                self._inspect()
            except Exception as exc:  # noqa: BLE001 - the store went away: the job is ending
                log.debug("stall inspector stopped on rank %d: %s", self.rank, exc)
                return

    def _publish(self) -> None:
        value = self._value()
        if value != self._published:
            self._store.set(str(self.rank), str(value))
            self._published = value

    def _read(self) -> dict[int, str | None]:
        """Every rank's last published value (None: nothing published)."""
        out: dict[int, str | None] = {}
        for r in range(self.world_size):
            key = str(r)
            out[r] = self._store.get(key).decode() if self._store.check([key]) else None
        return out

    def _inspect(self) -> None:
        since = self.wait_since
        if since is None or since != self._inspected:
            self._warned_at = None  # a new wait (possibly begun before this tick saw the last end)
            self._reported = False
            self._inspected = since
        if since is None:
            return
        waited = time.monotonic() - since
        limit, why = self.limit()
        if waited >= limit:
            abort(self.describe(waited), self.shutdown_s, self._exit, reason=why)
            return
        if waited >= self.report_at() and not self._reported:
            self._reported = True
            timeout = self._timeout()
            log.error(
                "%s. Its timeout (%gs; the job's is LONGBOAT_TIMEOUT) ends this wait in %.0f s",
                self.describe(waited),
                timeout,
                max(0.0, timeout - waited),
            )
            return
        due = self._warned_at is None or waited - self._warned_at >= self.warning_s
        if waited >= self.warning_s and due:
            self._warned_at = waited
            log.warning(
                "%s. Fix the slow or stuck rank (its log shows where it is); raise "
                "stall_warning_seconds if such waits are expected",
                self.describe(waited),
            )


class StallWatch(_Watcher):
    """This rank's gradient-bucket launch counter, its current wait, and the watching thread."""

    def __init__(
        self,
        store: dist.Store,
        key: str,
        rank: int,
        world_size: int,
        buckets: Buckets,
        warning_s: float,
        shutdown_s: float = 0.0,
        exit_fn: Callable[[int], None] = os._exit,
        timeout_s: float | None = None,
    ):
        self.history: list[tuple[int, list[list[str]]]] = [(0, [list(b) for b in buckets])]
        self.launches = 0  # buckets launched so far (written by the training thread only)
        self.handles: list[tuple[int, int, Any]] = []  # (launch number, bucket, handle) this step
        super().__init__(
            store,
            f"longboat/stall/{key}/",
            rank,
            world_size,
            warning_s,
            shutdown_s,
            exit_fn,
            timeout_s,
        )

    @property
    def buckets(self) -> list[list[str]]:
        """The bucket lists (parameter names) of the reducer in use."""
        return self.history[-1][1]

    @buckets.setter
    def buckets(self, buckets: Buckets) -> None:
        self.switch(buckets)

    def switch(self, buckets: Buckets) -> None:
        """Another reducer is installed (``Strategy(auto=True)``, at a step boundary, at the same
        launch count on every rank): launches from now on use ``buckets``."""
        new = [list(b) for b in buckets]
        if self.history[-1][0] == self.launches:
            self.history[-1] = (self.launches, new)  # nothing launched with the previous list
        else:
            self.history.append((self.launches, new))

    # -- hot path (training thread) -----------------------------------------------------------

    def launched(self, bucket: int, handle: Any) -> None:
        self.launches += 1
        self.handles.append((self.launches, bucket, handle))

    def begin_wait(self) -> None:
        self.wait_since = time.monotonic()

    def end_wait(self) -> None:
        self.wait_since = None
        self.handles = []

    # -- background thread ----------------------------------------------------------------------

    def _value(self) -> int:
        return self.launches

    def progress(self) -> dict[int, int | None]:
        """Every rank's last published launch count (None: nothing published)."""
        out = {r: None if v is None else int(v) for r, v in self._read().items()}
        out[self.rank] = self.launches
        return out

    def describe(self, waited: float) -> str:
        """The warning text for a wait of ``waited`` seconds."""
        pending = [(n, b) for n, b, h in list(self.handles) if not finished(h)]
        if pending:
            awaited, bucket = pending[0]
        else:
            awaited = self.launches
            bucket = bucket_of(awaited, self.history)[0] if awaited else 0
        report = missing_report(awaited, self.progress(), self.buckets, self.history)
        return (
            f"rank {self.rank} has waited {waited:.1f} s for the allreduce of bucket {bucket} "
            f"(launch {awaited}). {report}"
        )


class CollectiveWatch(_Watcher):
    """Named collectives on the world group other than gradient buckets: this rank counts the
    ones it entered (``waiting``) and names, when one stalls, the ranks that have not reached
    it with the last one they did reach."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        warning_s: float,
        shutdown_s: float = 0.0,
        exit_fn: Callable[[int], None] = os._exit,
        group: Any = None,
        timeout_s: float | None = None,
    ):
        self.group = group if group is not None else dist.group.WORLD
        self.count = 0  # collectives entered so far
        self.label = ""  # the last one entered
        self.inside = False
        super().__init__(
            store,
            "longboat/stall/collectives/",
            rank,
            world_size,
            warning_s,
            shutdown_s,
            exit_fn,
            timeout_s,
        )
        # joined before the interpreter finalises (also in multiprocessing children, which skip
        # atexit): a daemon thread caught inside a store call then aborts the process
        self._at_exit = multiprocessing.util.Finalize(
            self, self.close, args=(2.0,), exitpriority=20
        )

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread and drop the exit hook, whose reference to this watch would keep
        the process group (its Gloo threads and sockets) alive after ``lb.shutdown``."""
        super().close(timeout)
        self._at_exit.cancel()

    def _alive(self) -> bool:
        return dist.is_initialized() and dist.group.WORLD is self.group

    @contextlib.contextmanager
    def waiting(self, label: str, timeout_s: float | None = None) -> Any:
        """Count and time one collective named ``label`` (the body runs it); ``timeout_s``: its
        own timeout when it is not the job's."""
        self.count += 1
        self.label, self.inside = label, True
        self.wait_timeout_s = timeout_s
        self.wait_since = time.monotonic()
        try:
            yield
        finally:
            self.wait_since, self.inside = None, False

    def _value(self) -> str:
        return f"{self.count}:{int(self.inside)}:{self.label}"

    def progress(self) -> dict[int, tuple[int, bool, str] | None]:
        """Every rank's last published (count, inside, label) (None: nothing published)."""
        out: dict[int, tuple[int, bool, str] | None] = {}
        for r, v in self._read().items():
            if v is None:
                out[r] = None
            else:
                count, inside, label = v.split(":", 2)
                out[r] = (int(count), inside == "1", label)
        out[self.rank] = (self.count, self.inside, self.label)
        return out

    def describe(self, waited: float) -> str:
        awaited, label = self.count, self.label
        parts = []
        for r, p in sorted(self.progress().items()):
            if p is None:
                parts.append(f"{r}: [no progress published: not started, or dead]")
            elif p[0] < awaited:
                where = "still in" if p[1] else "after"
                last = f"{where} #{p[0]} {p[2]}" if p[0] else "none reached yet"
                parts.append(f"{r}: [not at it yet; last collective: {last}]")
        missing = "; ".join(parts) if parts else "none (all arrived; slow network?)"
        return (
            f"rank {self.rank} has waited {waited:.1f} s for the {label} (collective #{awaited}). "
            f"Missing ranks: {missing}"
        )


_collectives: CollectiveWatch | None = None  # this process group's; see `collective_watch`
_collectives_lock = threading.Lock()


def collective_watch() -> CollectiveWatch | None:
    """The running `CollectiveWatch` of the world group, or None (inspector off, one rank,
    before `watch_collectives` or after ``lb.shutdown``)."""
    return _collectives


def waiting(
    label: str, group: Any = None, timeout_s: float | None = None
) -> contextlib.AbstractContextManager[Any]:
    """``with waiting("barrier"): dist.barrier()``: watch the collective inside as ``label``
    (``timeout_s``: its own timeout when it is not the job's).

    Only collectives of the world group are counted (every rank issues them in the same order);
    with the inspector off, or another ``group``, this is a shared no-op context.
    """
    watch = collective_watch()
    if watch is None or (group is not None and group is not dist.group.WORLD):
        return _NULL
    return watch.waiting(label, timeout_s)


def watch_collectives(config: TraceConfig) -> CollectiveWatch | None:
    """Start (or retune) this process group's `CollectiveWatch` with ``config``'s
    ``stall_warning_seconds`` / ``stall_shutdown_seconds``; stop it when the warning is 0 or
    there is one rank. A watch started here is stopped by the next ``lb.shutdown``, before the
    process group goes."""
    global _collectives
    with _collectives_lock:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        warning, shutdown = config.stall_warning_seconds, config.stall_shutdown_seconds
        group = dist.group.WORLD
        old = _collectives
        if old is not None and old.group is group and warning > 0:
            old.retune(warning, shutdown)
            return old
        if old is not None:
            old.close(timeout=2.0)
            _collectives = None
        world = dist.get_world_size()
        if warning <= 0 or world == 1:
            return None
        store = dist.distributed_c10d._get_default_store()
        _collectives = CollectiveWatch(
            store, dist.get_rank(), world, warning, shutdown, group=group
        )
        on_shutdown(stop_collective_watch)
        return _collectives


def stop_collective_watch() -> None:
    """Stop watching (the process group is going away)."""
    global _collectives
    with _collectives_lock:
        watch, _collectives = _collectives, None
    if watch is not None:
        watch.close(timeout=2.0)
