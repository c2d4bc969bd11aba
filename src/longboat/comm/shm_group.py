"""A group's shared-memory segments and their synchronisation: what every shm collective
(`longboat.comm.algorithms.shm`) runs on.

Each rank of a node-local group owns one segment (`longboat.comm.shm_segment`) that every peer
maps. An op ``k`` announces its progress in the rank's own counters (``written``, ``reduced``);
a rank waits for its peers' counters to reach ``k`` before reading what they wrote. Waits spin
(``os.sched_yield``) for 2 ms, then back off to short sleeps, check every peer's owner process
about four times a second (a dead peer raises within a second and removes all the group's
segments) and give up after LONGBOAT_TIMEOUT seconds (default 300). A rank that raises writes
its rank into every segment's abort slot, so the others stop at once too.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.util
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from longboat.cluster import job_timeout, on_group_end
from longboat.comm.exchange import control_device
from longboat.comm.shm_segment import (
    NAME_PREFIX,
    PAGE,
    SLOT_ABORT,
    SLOT_ABORT_DEAD,
    SLOT_WRITTEN,
    Segment,
    cleanup_stale_segments,
    pid_alive,
    remove_group,
    shm_dir,
)

PIECE_BYTES = 4 << 20  # large tensors go through in pieces of this size (measured: 2-4 MB best)
SMALL_BYTES = 64 << 10  # up to this size every rank sums everything (one barrier per op)
MIN_CAPACITY = 64 << 10
SPIN_S = 2e-3  # poll with sched_yield this long before backing off to sleeps
MIN_SLEEP_S, MAX_SLEEP_S = 20e-6, 500e-6
LIVENESS_EVERY_S = 0.25
_HINT = (
    "; do all ranks call allreduce with the same sizes in the same order? "
    "(raise LONGBOAT_TIMEOUT if a rank is just slow)"
)
_BEHIND_HINT = (
    ": {who} not reached this allreduce: stuck, slow, or calling fewer allreduces than this "
    "rank; its log shows where it is (raise LONGBOAT_TIMEOUT if it is just slow)"
)
_NAME_BYTES = 24  # broadcast: name (NUL-padded) + 8 bytes of token


SUPPORTED = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.int8,
    torch.uint8,
)


class PeerDiedError(RuntimeError):
    """A rank of the group exited while others waited for it; ``rank`` is its group rank."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


class PeerFailedError(RuntimeError):
    """Another rank of the group raised inside the shm allreduce (and flagged it)."""


def capacity_for(nbytes: int, piece_bytes: int) -> int:
    """Data-area size for ``nbytes``: the next power of two, at least 64 KiB, whole pages."""
    want = max(MIN_CAPACITY, 1 << max(0, nbytes - 1).bit_length())
    return -(-min(want, max(piece_bytes, nbytes)) // PAGE) * PAGE


class ShmGroup:
    """The segments of ``group``, whose ranks must share this node, and their counters.

    Collective constructor: every rank of ``group`` builds it in the same order. ``prefix``
    (tests only) fixes the segment name prefix instead of a random one. The collectives
    (`longboat.comm.algorithms.shm.ShmComm`) build on `_begin`, `_publish` and `_wait_all`.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        timeout: float | None = None,
        piece_bytes: int = PIECE_BYTES,
        small_bytes: int = SMALL_BYTES,
        prefix: str | None = None,
    ):
        self.group = group if group is not None else dist.group.WORLD
        self.ranks = dist.get_process_group_ranks(self.group)
        self.rank, self.size = dist.get_rank(self.group), len(self.ranks)
        self.timeout = job_timeout().total_seconds() if timeout is None else float(timeout)
        self.piece_bytes, self.small_bytes = max(PAGE, piece_bytes), small_bytes
        self._device = control_device(self.group)
        if not shm_dir().is_dir():
            raise RuntimeError(
                f"shm allreduce needs a shared-memory directory: {shm_dir()} does not exist "
                "(set LONGBOAT_SHM_DIR to a tmpfs, or use the 'native' algorithm)"
            )
        self._seq = self._gen = 0
        self._error: str | None = None
        self._closed = False
        check_one_node(self.group, self.ranks, self._device)
        self.prefix, self._token = self._agree_on_name(prefix)
        self._capacity = capacity_for(0, self.piece_bytes)
        self._segs: list[Segment | None] = [None] * self.size
        problem = None
        try:
            self._segs[self.rank] = Segment.create(
                self.prefix, self.rank, 0, self._token, self._capacity, 0
            )
        except OSError as exc:  # reported collectively below, so no rank is left waiting
            problem = exc
        _track(self)
        self._check_peers_visible(problem)

    # ---- setup -------------------------------------------------------------------------
    def _agree_on_name(self, prefix: str | None) -> tuple[str, int]:
        """Rank 0 draws the segment prefix and token; everyone receives them (no pickle)."""
        if prefix is not None and (len(prefix.encode()) > _NAME_BYTES or "/" in prefix):
            raise ValueError(f"shm segment prefix {prefix!r}: at most {_NAME_BYTES} bytes, no /")
        buf = torch.zeros(_NAME_BYTES + 8, dtype=torch.uint8)
        if self.rank == 0:
            with contextlib.suppress(OSError):
                cleanup_stale_segments()  # leftovers of crashed runs on this node
            name = (prefix or f"{NAME_PREFIX}{secrets.token_hex(6)}").encode()
            token = secrets.randbits(63) or 1
            raw = name.ljust(_NAME_BYTES, b"\0") + token.to_bytes(8, "little")
            buf.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        moved = buf.to(self._device)
        dist.broadcast(moved, src=self.ranks[0], group=self.group)
        raw = bytes(moved.cpu().tolist())
        return raw[:_NAME_BYTES].rstrip(b"\0").decode(), int.from_bytes(raw[_NAME_BYTES:], "little")

    def _check_peers_visible(self, problem: OSError | None) -> None:
        """Every rank must map every peer's segment and see its process, else all raise."""
        dist.barrier(group=self.group)
        seen = torch.zeros(self.size, dtype=torch.int32)
        seen[self.rank] = int(problem is None and all(self._attach_once(p) for p in self._peers()))
        moved = seen.to(self._device)
        dist.all_reduce(moved, group=self.group)
        blind = [r for r, ok in enumerate(moved.cpu().tolist()) if not ok]
        if blind:
            self.close()
            mine = f" (here: {problem})" if problem is not None else ""
            raise RuntimeError(
                f"shm allreduce: group ranks {blind} could not create their segment or map "
                f"their peers' segments in {shm_dir()}{mine}, or cannot see the peers' "
                "processes: the ranks are not on one node, /dev/shm is full, or /dev/shm or "
                "the pid namespace is not shared; use 'native' instead"
            ) from problem

    def _attach_once(self, peer: int) -> bool:
        seg = Segment.attach(self.prefix, peer, self._gen, self._token, self._capacity)
        self._segs[peer] = seg
        return seg is not None and pid_alive(seg.pid, seg.start_time)

    def _peers(self) -> list[int]:
        return [r for r in range(self.size) if r != self.rank]

    def _checked(self, dtype: torch.dtype) -> None:
        """Raise unless this group can run an op on ``dtype`` now."""
        if self._error is not None:
            raise RuntimeError(
                f"shm allreduce {self.prefix} is unusable after an error: {self._error}"
            )
        if self._closed:
            raise RuntimeError(f"shm allreduce {self.prefix} is closed")
        if dtype not in SUPPORTED:
            names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED)
            raise TypeError(f"shm allreduce does not support {dtype}; supported: {names}")

    def _begin(self, nbytes: int) -> tuple[int, int]:
        """Next sequence number, with data areas of at least ``nbytes``; returns (seq, input
        area)."""
        self._seq += 1
        if nbytes > self._capacity:
            self._grow(capacity_for(nbytes, self.piece_bytes))
        return self._seq, self._seq % 2

    # ---- synchronisation ---------------------------------------------------------------
    def _publish(self, slot: int, k: int) -> None:
        self._segs[self.rank].slots[slot] = k

    def _wait_all(self, slot: int, k: int, phase: str) -> None:
        """Until every peer's counter ``slot`` reaches ``k``; raises on death or timeout."""
        waiting = [r for r in self._peers() if self._segs[r].slots[slot] < k]
        if not waiting:
            return
        now = time.monotonic()
        spin_until, check_at, deadline = now + SPIN_S, now + LIVENESS_EVERY_S, now + self.timeout
        pause, mine = MIN_SLEEP_S, self._segs[self.rank].slots
        while waiting:
            if mine[SLOT_ABORT]:
                raise self._aborted(mine, phase, k)
            if now < spin_until:
                os.sched_yield()  # releases the GIL; time.sleep(0) costs ~80 us here
            else:
                time.sleep(pause)
                pause = min(pause * 2, MAX_SLEEP_S)
            waiting = [r for r in waiting if self._segs[r].slots[slot] < k]
            now = time.monotonic()
            if waiting and now >= check_at:
                self._check_alive(phase, k)
                check_at = now + LIVENESS_EVERY_S
            if waiting and now > deadline:
                raise TimeoutError(self._stuck_message(waiting, slot, k, phase))

    def _check_alive(self, phase: str, k: int) -> None:
        for r in self._peers():
            seg = self._segs[r]
            if not pid_alive(seg.pid, seg.start_time):
                raise self._died(r, seg.pid, phase, k)

    def _died(self, r: int, pid: int, phase: str, k: int, seen_by: str = "") -> PeerDiedError:
        return PeerDiedError(
            f"shm allreduce {self.prefix}: group rank {r} (global rank {self.ranks[r]}, pid "
            f"{pid}) died{seen_by} while group rank {self.rank} waited for '{phase}' #{k}; "
            "the group's shared-memory segments were removed",
            r,
        )

    def _aborted(self, slots: memoryview, phase: str, k: int) -> RuntimeError:
        """The error for an abort flag in my segment: the dead rank's, else the failed one's."""
        failed, dead = slots[SLOT_ABORT] - 1, slots[SLOT_ABORT_DEAD] - 1
        if dead >= 0:
            pid = self._segs[dead].pid if self._segs[dead] is not None else -1
            return self._died(dead, pid, phase, k, f" (noticed by group rank {failed})")
        return PeerFailedError(
            f"shm allreduce {self.prefix}: group rank {failed} (global rank "
            f"{self.ranks[failed]}) failed (see its error) while group rank {self.rank} waited "
            f"for '{phase}' #{k}; the group's shared-memory segments were removed"
        )

    def _stuck_message(self, waiting: list[int], slot: int, k: int, phase: str) -> str:
        where = ", ".join(f"rank {r} at #{self._segs[r].slots[slot]}" for r in waiting)
        hint = _HINT
        if slot == SLOT_WRITTEN:  # a rank's first act in an allreduce: these never began #k
            ranks = ", ".join(map(str, waiting))
            who = f"rank {ranks} has" if len(waiting) == 1 else f"ranks {ranks} have"
            hint = _BEHIND_HINT.format(who=who)
        return (
            f"shm allreduce {self.prefix}: group rank {self.rank} waited {self.timeout:.0f}s "
            f"for '{phase}' #{k} ({where}){hint}"
        )

    def _grow(self, capacity: int) -> None:
        """Re-create my segment at ``capacity`` (next generation) and map the peers' new ones."""
        self._gen += 1
        self._capacity = capacity
        old = self._segs[self.rank]
        self._segs[self.rank] = Segment.create(
            self.prefix, self.rank, self._gen, self._token, capacity, self._seq - 1
        )
        old.close(unlink=True)  # peers still reading it keep their own mapping
        for r in self._peers():
            self._segs[r].close()
            self._segs[r] = self._wait_attach(r)

    def _wait_attach(self, peer: int) -> Segment:
        deadline = time.monotonic() + self.timeout
        check_at = time.monotonic() + LIVENESS_EVERY_S
        while True:
            seg = Segment.attach(self.prefix, peer, self._gen, self._token, self._capacity)
            if seg is not None:
                return seg
            mine = self._segs[self.rank].slots
            if mine[SLOT_ABORT]:
                raise self._aborted(mine, f"segment generation {self._gen}", self._seq)
            now = time.monotonic()
            if now >= check_at:
                self._check_alive(f"segment generation {self._gen}", self._seq)
                check_at = now + LIVENESS_EVERY_S
            if now > deadline:
                raise TimeoutError(
                    f"shm allreduce {self.prefix}: group rank {peer} did not create segment "
                    f"generation {self._gen} within {self.timeout:.0f}s{_HINT}"
                )
            time.sleep(MIN_SLEEP_S)

    # ---- teardown ----------------------------------------------------------------------
    def _guarded(self, fn: Callable[..., None], *args: Any) -> None:
        """``fn(*args)``; if it raises, the group fails (`_fail`) before the error goes on."""
        try:
            fn(*args)
        except BaseException as exc:
            self._fail(exc)
            raise

    def _fail(self, exc: BaseException) -> None:
        """After an error the group's segments are gone and this object refuses more work."""
        self._error = f"{type(exc).__name__}: {exc}"
        dead = exc.rank + 1 if isinstance(exc, PeerDiedError) else 0
        for seg in self._segs:  # tell peers still waiting (in their own segments)
            if seg is not None and seg.is_open and not seg.slots[SLOT_ABORT]:
                seg.slots[SLOT_ABORT_DEAD] = dead
                seg.slots[SLOT_ABORT] = self.rank + 1
        self._release(unlink_all=True)

    def close(self) -> None:
        """Unlink my segment and unmap all; safe to call twice."""
        self._closed = True
        self._release(unlink_all=False)

    def _release(self, unlink_all: bool) -> None:
        for r, seg in enumerate(self._segs):
            if seg is not None:
                seg.close(unlink=r == self.rank)
        self._segs = [None] * self.size
        if unlink_all:
            remove_group(self.prefix)
        _untrack(self)


def check_one_node(group: dist.ProcessGroup, ranks: list[int], device: torch.device) -> None:
    """Raise ValueError unless every rank of ``group`` runs on this node (collective)."""
    import longboat.cluster as cluster
    from longboat.cluster.topology import gather_topology, node_key

    if cluster.is_initialized():
        node_of = [cluster.topology().node_of[r] for r in ranks]
    else:
        node_of = list(gather_topology(node_key(None), device, group).node_of)
    if len(set(node_of)) > 1:
        raise ValueError(
            f"shm allreduce needs every rank of the group on one node, but global ranks {ranks} "
            f"are on nodes {node_of}; use 'native', or 'hierarchical' (shm inside each node)"
        )


# ---- exit hooks: every live ShmGroup unlinks its segment when lb.shutdown() destroys its
# process group and at exit, also in multiprocessing children
_LIVE: weakref.WeakSet[ShmGroup] = weakref.WeakSet()
_HOOKED = threading.Lock()
_hooked = False


def _track(comm: ShmGroup) -> None:
    global _hooked
    with _HOOKED:
        _LIVE.add(comm)
        on_group_end(_closer(comm))  # its process group ends there: so do its segments
        if not _hooked:
            atexit.register(_close_all)
            multiprocessing.util.Finalize(None, _close_all, exitpriority=100)
            _hooked = True


def _closer(comm: ShmGroup) -> Callable[[], None]:
    """Close ``comm`` if it is still alive (the hook does not keep it alive)."""
    ref = weakref.ref(comm)

    def close() -> None:
        live = ref()
        if live is not None:
            live.close()

    return close


def _untrack(comm: ShmGroup) -> None:
    _LIVE.discard(comm)


def _close_all() -> None:
    for comm in list(_LIVE):
        comm.close()
