"""Stall inspector: which ranks have not reached the collective this rank waits for.

Every rank counts the buckets it has launched (an integer increment on the hot path). A
background thread publishes the latest count to the c10d store, at most once per tick and
only when it changed, so training never makes a store round trip. When this rank has waited
longer than ``stall_warning_seconds`` for its allreduces, the same thread reads every rank's
count and logs, like Horovod::

    rank 0 has waited 2.0 s for the allreduce of bucket 0 (launch 7). Missing ranks:
    1: [net.2.weight, net.2.bias]

A rank that launched fewer buckets than the one awaited has not produced those gradients yet.
After ``stall_shutdown_seconds`` (0: never) the message is logged as an error and the process
exits with `STALL_EXIT_CODE`, which the launcher reports as that rank's failure. Works on any
backend: it needs only the store, not the backend's own watchdog.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from longboat.log import get_logger

log = get_logger("longboat.stall")

#: exit status of a rank that the stall inspector shut down (EX_SOFTWARE)
STALL_EXIT_CODE = 70
_MAX_NAMES = 8


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


def missing_report(
    awaited: int, progress: dict[int, int | None], buckets: Sequence[Sequence[str]]
) -> str:
    """``Missing ranks: r: [names...]`` for the ranks whose launch count is below ``awaited``.

    ``awaited`` is the 1-based launch number this rank waits on; every synchronised backward
    launches buckets 0..n-1 in order, so launch m is bucket (m - 1) % n.
    """
    n = len(buckets)
    parts = []
    for rank, done in sorted(progress.items()):
        if done is None:
            parts.append(f"{rank}: [no progress published: not started, or dead]")
            continue
        if done >= awaited:
            continue
        first = done % n if awaited - done <= n else 0
        last = (awaited - 1) % n
        names = [name for b in range(first, last + 1) for name in buckets[b]]
        shown = ", ".join(names[:_MAX_NAMES]) + (", ..." if len(names) > _MAX_NAMES else "")
        parts.append(f"{rank}: [{shown}]")
    return "Missing ranks: " + ("; ".join(parts) if parts else "none (all arrived; slow network?)")


class StallWatch:
    """This rank's launch counter, its current wait, and the thread that publishes and watches."""

    def __init__(
        self,
        store: dist.Store,
        key: str,
        rank: int,
        world_size: int,
        buckets: Sequence[Sequence[str]],
        warning_s: float,
        shutdown_s: float = 0.0,
        exit_fn: Callable[[int], None] = os._exit,
    ):
        self._store = dist.PrefixStore(f"longboat/stall/{key}/", store)
        self.rank = rank
        self.world_size = world_size
        self.buckets = [list(b) for b in buckets]
        self.warning_s = warning_s
        self.shutdown_s = shutdown_s
        self._exit = exit_fn
        self.launches = 0  # buckets launched so far (written by the training thread only)
        self.handles: list[tuple[int, int, Any]] = []  # (launch number, bucket, handle) this step
        self.wait_since: float | None = None
        self._published = -1
        self._warned_at: float | None = None
        self._tick = min(1.0, max(0.05, warning_s / 4))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="longboat-stall", daemon=True)
        self._thread.start()

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

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self._tick):
            try:
                self._publish()
                self._inspect()
            except Exception as exc:  # noqa: BLE001 - the store went away: the job is ending
                log.debug("stall inspector stopped on rank %d: %s", self.rank, exc)
                return

    def _publish(self) -> None:
        count = self.launches
        if count != self._published:
            self._store.set(str(self.rank), str(count))
            self._published = count

    def _inspect(self) -> None:
        since = self.wait_since
        if since is None:
            self._warned_at = None
            return
        waited = time.monotonic() - since
        if self.shutdown_s > 0 and waited >= self.shutdown_s:
            message = self.describe(waited)
            log.error(
                "%s. Shutting down (stall_shutdown_seconds=%g): exit %d",
                message,
                self.shutdown_s,
                STALL_EXIT_CODE,
            )
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            self._exit(STALL_EXIT_CODE)
            return
        due = self._warned_at is None or waited - self._warned_at >= self.warning_s
        if waited >= self.warning_s and due:
            self._warned_at = waited
            log.warning(
                "%s. Fix the slow or stuck rank (its log shows where it is); raise "
                "stall_warning_seconds if such waits are expected",
                self.describe(waited),
            )

    def progress(self) -> dict[int, int | None]:
        """Every rank's last published launch count (None: nothing published)."""
        out: dict[int, int | None] = {}
        for r in range(self.world_size):
            key = str(r)
            out[r] = int(self._store.get(key)) if self._store.check([key]) else None
        out[self.rank] = self.launches
        return out

    def describe(self, waited: float) -> str:
        """The warning text for a wait of ``waited`` seconds."""
        pending = [(n, b) for n, b, h in list(self.handles) if not finished(h)]
        awaited, bucket = (
            pending[0] if pending else (self.launches, (self.launches - 1) % len(self.buckets))
        )
        return (
            f"rank {self.rank} has waited {waited:.1f} s for the allreduce of bucket {bucket} "
            f"(launch {awaited}). {missing_report(awaited, self.progress(), self.buckets)}"
        )
