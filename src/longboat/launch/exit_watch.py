"""Note when each worker process of one attempt exits, as its parent (the agent) sees it.

torch's agent polls its workers every ``monitor_interval`` and times failures from error files
in whole seconds, so ranks that fail within one poll or one second are not ordered. `ExitWatch`
waits on a pidfd per worker in a thread and notes the moment each one exits, and its status,
without reaping it (torch still collects it); where pidfds are not available the agent's own
polls (`ExitWatch.check`) note exits instead. `ExitWatch.stopping` is called just before the
launcher signals the workers: those still running then are the ones it stopped.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from collections.abc import Mapping

from longboat.launch.bootstrap import STACKS_SIGNAL
from longboat.launch.exits import WorkerEnd

_RUNNING = object()
#: how long the survivors get to write their stacks before the launcher stops them (the
#: handler runs at delivery; and a SIGTERM pending beside it is delivered after it, by number)
STACKS_WAIT_S = 0.05


def exit_status(pid: int) -> object:
    """A child's exit status without reaping it: the code (negative: signal), None when it was
    already reaped (status unknown here), or `_RUNNING`."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None
    if info is None or info.si_pid == 0:
        return _RUNNING
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``signum`` (Linux: ``SigCgt`` of
    /proc/PID/status); False where that cannot be read."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


class ExitWatch:
    """Exit times and statuses of the workers ``pids`` (global rank -> pid) of one attempt."""

    def __init__(self, pids: Mapping[int, int], error_files: Mapping[int, str] | None = None):
        self._pids = dict(pids)
        self._error_files = dict(error_files or {})
        self._started = time.time()
        self._lock = threading.Lock()
        self._seen: dict[int, tuple[float, float, int | None]] = {}  # wall, monotonic, code
        self._stopped: set[int] | None = None
        self._wake_r, self._wake_w = os.pipe()
        self._thread: threading.Thread | None = None
        if hasattr(os, "pidfd_open"):
            self._thread = threading.Thread(
                target=self._watch, name="longboat-exit-watch", daemon=True
            )
            self._thread.start()

    def check(self) -> None:
        """Note every worker that has exited by now."""
        for rank in self._pids:
            self._note(rank)

    def stopping(self) -> None:
        """The launcher is about to stop the workers: remember which ones still run (once).
        When one has failed, each survivor first writes its threads' stacks to its log."""
        with self._lock:
            if self._stopped is not None:
                return
            self._stopped = set()
        for rank in self._pids:
            if not self._note(rank):
                self._stopped.add(rank)
        if self._stopped and self.any_failed():
            self._ask_for_stacks(sorted(self._stopped))

    def _ask_for_stacks(self, ranks: list[int]) -> None:
        asked = False
        for rank in ranks:
            pid = self._pids[rank]
            if catches(pid, STACKS_SIGNAL):  # else the signal's default would kill it
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, STACKS_SIGNAL)
                    asked = True
        if asked:
            time.sleep(STACKS_WAIT_S)  # faulthandler writes from its signal handler: at once

    def any_failed(self) -> bool:
        """Whether a worker has exited with a non-zero status by now."""
        self.check()
        with self._lock:
            return any(code not in (None, 0) for _, _, code in self._seen.values())

    def first_seen(self) -> float | None:
        """time.monotonic() when the first worker was seen exited, if one was."""
        with self._lock:
            return min((m for _, m, _ in self._seen.values()), default=None)

    def ends(self, codes: Mapping[int, int] | None = None) -> list[WorkerEnd]:
        """What was seen of every worker; ``codes`` (torch's) fill statuses not read here."""
        self.check()
        codes = codes or {}
        out = []
        with self._lock:
            stopped = self._stopped or set()
            for rank in sorted(self._pids):
                wall, _, code = self._seen.get(rank, (None, None, None))
                out.append(
                    WorkerEnd(
                        rank=rank,
                        exitcode=code if code is not None else codes.get(rank),
                        seen_at=wall,
                        raised_at=self._raised_at(rank),
                        stopped=rank in stopped,
                        error_file=self._error_files.get(rank, ""),
                    )
                )
        return out

    def close(self) -> None:
        """Stop the thread (workers torch could not end are left to it)."""
        if self._wake_w < 0:
            return
        os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join()
        os.close(self._wake_w)
        os.close(self._wake_r)
        self._wake_w = self._wake_r = -1

    def _raised_at(self, rank: int) -> float | None:
        """When the rank wrote its error file during this attempt, if it did."""
        try:
            written = os.path.getmtime(self._error_files[rank])
        except (KeyError, OSError):
            return None
        return written if written >= self._started - 1.0 else None

    def _note(self, rank: int) -> bool:
        """Record the worker's exit if it has exited (first sighting only); True if it has."""
        wall, mono = time.time(), time.monotonic()
        status = exit_status(self._pids[rank])
        if status is _RUNNING:
            return False
        code = status if isinstance(status, int) else None
        with self._lock:
            if rank not in self._seen:
                self._seen[rank] = (wall, mono, code)
            elif self._seen[rank][2] is None and code is not None:
                self._seen[rank] = (*self._seen[rank][:2], code)
        return True

    def _watch(self) -> None:
        fds: dict[int, int] = {}
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        try:
            for rank, pid in self._pids.items():
                with contextlib.suppress(OSError):  # already reaped: the polls note it
                    fd = os.pidfd_open(pid)
                    fds[fd] = rank
                    poller.register(fd, select.POLLIN)
            while fds:
                for fd, _ in poller.poll():
                    if fd == self._wake_r:
                        return
                    poller.unregister(fd)
                    self._note(fds.pop(fd))
                    os.close(fd)
        finally:
            for fd in fds:
                os.close(fd)
