"""Name-keyed negotiation: ranks submit named collectives in any order and still meet.

This is Horovod's controller on torch.distributed:

* Every ``hvd`` collective is a :class:`Work` carrying a :class:`Request` (name, kind, dtype,
  shape, op, scale factors, root, splits), queued on this rank.
* One background thread per rank runs *cycles*. In a cycle every rank allgathers one small
  JSON record over a dedicated control group (``comm.exchange.allgather_bytes``; JSON, never
  pickle): the requests it submitted since the last cycle, each either in full or, when an
  identical request was agreed before, as its integer id in the *response cache* (Horovod's
  response cache): in steady state a record is a short list of integers.
* From the gathered records every rank builds the same table ``name -> {rank: request}``. A
  name is ready once every rank that has not ``join()``-ed submitted it; ready names are
  processed in the order they first appeared (cycle, rank, position), which every rank
  computes identically, so the collectives that follow match on every rank.
* A ready name whose requests disagree (operation, dtype, shape, reduction, root), or that
  Horovod refuses while a rank has joined, fails on every rank with the reason (``Mismatched
  ALLREDUCE tensor shapes ...`` naming the ranks and values): an error, never a hang. An op
  whose collective raises fails alone; the next cycles go on.
* One controller negotiates one process set: every rank for ``hvd.init()``'s, the members of
  a registered ``hvd.ProcessSet`` for its own (``process_sets.py``); ranks are positions in
  the set.
* Ready allreduces with the same dtype, device, op and scale factors are fused by the core's
  bucket planner (capped at ``HOROVOD_FUSION_THRESHOLD`` bytes, default 64 MiB) and summed
  with the core's allreduce algorithm (``Strategy.allreduce_algorithm``) on a data group;
  broadcasts travel coalesced through the core's ``broadcast_state``.
* A thread cycles only while its rank has work outstanding (or has joined); between cycles it
  sleeps ``HOROVOD_CYCLE_TIME`` ms (default 1) so bursts of submissions share one cycle. Both
  groups carry the job's timeout (``LONGBOAT_TIMEOUT``, default 300 s): a peer that never
  submits makes the control allgather fail within it, and every waiting handle then raises
  :class:`HorovodInternalError` saying so.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from longboat.collective.buckets import MB
from longboat.comm import algorithms
from longboat.comm.exchange import allgather_bytes
from longboat.comm.groups import make_communicators
from longboat.comm.streams import WorkerStreams
from longboat.horovod.torch.execution import Collectives
from longboat.horovod.torch.requests import (
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    BARRIER,
    BROADCAST,
    REDUCESCATTER,
    HorovodInternalError,
    ReduceOp,
    Request,
    Response,
    Work,
    join_error,
    mismatch,
    scatter_rows,
)

log = logging.getLogger("longboat.horovod")

DEFAULT_FUSION_BYTES = 64 * MB
DEFAULT_CYCLE_MS = 1.0
DEFAULT_CACHE_CAPACITY = 1024
DEFAULT_STALL_WARNING_S = 60.0


@dataclass
class Stats:
    """Counters of this rank's negotiation (what the response cache saves is visible here)."""

    cycles: int = 0
    full_requests: int = 0
    cached_requests: int = 0


def env_float(name: str, default: float) -> float:
    """``name``'s value as a float, ``default`` when unset or empty."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None


class Controller(Collectives):
    """The per-rank negotiation thread and the collectives it runs; see the module docstring."""

    def __init__(
        self,
        rank: int,
        world: int,
        timeout_s: float,
        algorithm: str = "native",
        groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None,
        options: Mapping[str, Any] | None = None,
    ):
        """``rank``/``world`` within the ranks negotiating (a process set's, or every rank);
        ``groups``: its (control, data) process groups, made here over every rank if None;
        ``algorithm`` and ``options``: the plan's (`longboat.collective.plan.CommPlan`)."""
        self.rank = rank
        self.world = world
        self.timeout_s = timeout_s
        self.fusion_bytes = int(env_float("HOROVOD_FUSION_THRESHOLD", DEFAULT_FUSION_BYTES))
        self._streams = WorkerStreams()
        self.cycle_s = env_float("HOROVOD_CYCLE_TIME", DEFAULT_CYCLE_MS) / 1000.0
        self.cache_capacity = int(env_float("HOROVOD_CACHE_CAPACITY", DEFAULT_CACHE_CAPACITY))
        self.stall_s = env_float("HOROVOD_STALL_CHECK_TIME_SECONDS", DEFAULT_STALL_WARNING_S)
        if groups is None:
            groups = (*make_communicators(2),)  # bounded by the job's timeout
        self.control, self.data = groups
        self._sum = algorithms.make(algorithm, self.data, options)
        # torch's current CUDA device is per thread: the negotiation thread adopts this one
        nccl = dist.get_backend(self.data) == "nccl"
        self._cuda_device = torch.cuda.current_device() if nccl else None
        self.stats = Stats()
        self._cv = threading.Condition()
        self._new: list[Work] = []
        self._outstanding: dict[str, Work] = {}
        self._join: Work | None = None
        self._join_sent = False
        self._stop = False
        self._broken: HorovodInternalError | None = None
        # identical on every rank (built only from gathered records):
        self._table: dict[str, dict[int, Request]] = {}
        self._seen_at: dict[str, float] = {}
        self._warned: set[str] = set()
        self._cache: list[Request] = []
        self._cache_ids: dict[Request, int] = {}
        self._joined: set[int] = set()
        self._last_joined = -1
        self._unnamed: dict[str, int] = {}
        self._thread = threading.Thread(
            target=self._run, name="longboat-horovod-negotiation", daemon=True
        )
        self._thread.start()

    # -- caller side ---------------------------------------------------------------------------

    def name_for(self, kind: str, name: str | None) -> str:
        """``name``, or Horovod's ``<op>.noname.<n>``: unnamed ops meet in submission order."""
        if name is not None:
            return str(name)
        with self._cv:
            n = self._unnamed[kind] = self._unnamed.get(kind, -1) + 1
        return f"{kind.lower()}.noname.{n}"

    def submit(self, work: Work) -> Work:
        """Queue ``work``; its result arrives when every rank has submitted its name."""
        with self._cv:
            self._raise_if_broken()
            name = work.request.name
            if name in self._outstanding:
                raise ValueError(  # Horovod's duplicate-name error is a ValueError too
                    f"Requested a {work.request.kind.lower()} named {name!r}, the same name as "
                    "another collective that is currently being processed on this rank. "
                    "synchronize() that one first, or use a different name"
                )
            self._outstanding[name] = work
            self._new.append(work)
            self._cv.notify()
        return work

    def join(self) -> Work:
        """Queue this rank's join; the work's result is the last rank to join."""
        with self._cv:
            self._raise_if_broken()
            if self._join is not None:
                raise HorovodInternalError(f"rank {self.rank}: join() is already in progress")
            self._join = Work(Request("join", "JOIN"), None)
            self._join_sent = False
            self._cv.notify()
            return self._join

    def wait(self, work: Work) -> Any:
        """Block until ``work`` finished (bounded by the job timeout); its result or error."""
        if not work.done.wait(self.timeout_s + 30.0):
            missing = self.missing_ranks(work.request.name)
            raise HorovodInternalError(
                f"rank {self.rank}: {work.request.kind} {work.request.name!r} did not complete "
                f"within {self.timeout_s + 30.0:.0f}s; ranks that have not submitted it: "
                f"{missing or 'unknown'}. Every rank must submit the same named collectives"
            )
        if work.error is not None:
            raise work.error
        return work.ordered_result()

    def missing_ranks(self, name: str) -> list[int]:
        with self._cv:
            have = self._table.get(name, {})
            return [r for r in range(self.world) if r not in have and r not in self._joined]

    @property
    def broken(self) -> bool:
        """True once the control group failed (a peer died or timed out): nothing more can run."""
        return self._broken is not None

    def close(self, grace_s: float = 10.0) -> None:
        """Stop the thread; work still outstanding fails with HorovodInternalError."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(grace_s)
        if self._thread.is_alive():
            log.warning(
                "rank %d: longboat.horovod's negotiation thread is still inside a collective "
                "after %.0fs (another rank has not called shutdown()); leaving it behind",
                self.rank,
                grace_s,
            )
        self._fail_all(HorovodInternalError("longboat.horovod has been shut down"))
        for group in (self.control, self.data):
            try:
                dist.destroy_process_group(group)
            except Exception as exc:  # noqa: BLE001 - teardown: report, never mask shutdown
                log.debug("destroying a horovod process group failed: %s", exc)

    # -- background thread ---------------------------------------------------------------------

    def _raise_if_broken(self) -> None:
        if self._broken is not None:
            raise self._broken
        if self._stop:
            raise HorovodInternalError("longboat.horovod has been shut down; call hvd.init()")

    def _run(self) -> None:
        try:
            if self._cuda_device is not None:
                torch.cuda.set_device(self._cuda_device)
            while True:
                record = self._next_record()
                if record is None:
                    return
                gathered = [json.loads(b) for b in allgather_bytes(record, self.control)]
                self.stats.cycles += 1
                self._execute(self._resolve(gathered))
                self._finish_join()
        except BaseException as exc:  # noqa: BLE001 - delivered to every waiting handle
            self._fail_all(
                HorovodInternalError(
                    f"rank {self.rank}: negotiation with the other ranks failed "
                    f"({type(exc).__name__}: {exc}). Another rank may have died, called "
                    "shutdown(), or stopped submitting the collectives this rank waits for "
                    f"(outstanding here: {sorted(self._outstanding) or 'none'})"
                ),
                broken=True,
            )

    def _next_record(self) -> bytes | None:
        """This rank's record for the next cycle, or None to stop."""
        with self._cv:
            while not self._stop and not self._outstanding and self._join is None:
                self._cv.wait()
            if self._stop:
                return None
        time.sleep(self.cycle_s)  # let a burst of submissions share this cycle
        with self._cv:
            batch, self._new = self._new, []
            join = self._join is not None and not self._join_sent
            self._join_sent = self._join_sent or join
        entries: list[Any] = []
        for work in batch:
            cached = self._cache_ids.get(work.request)
            if cached is None:
                entries.append(work.request.record())
                self.stats.full_requests += 1
            else:
                entries.append(cached)
                self.stats.cached_requests += 1
        return json.dumps({"q": entries, "j": int(join)}, separators=(",", ":")).encode()

    def _resolve(self, gathered: list[dict[str, Any]]) -> list[Response]:
        """Update the shared table from every rank's record; the responses now ready."""
        now = time.monotonic()
        with self._cv:
            for r, record in enumerate(gathered):
                for entry in record["q"]:
                    req = (
                        self._cache[entry] if isinstance(entry, int) else Request.from_record(entry)
                    )
                    self._table.setdefault(req.name, {})[r] = req
                    self._seen_at.setdefault(req.name, now)
                if record["j"]:
                    self._joined.add(r)
                    self._last_joined = r
            active = [r for r in range(self.world) if r not in self._joined]
            ready = [n for n, reqs in self._table.items() if all(r in reqs for r in active)]
            responses = []
            for name in ready:
                requests = dict(sorted(self._table.pop(name).items()))
                self._seen_at.pop(name, None)
                self._warned.discard(name)
                error = mismatch(name, requests) or join_error(
                    name, next(iter(requests.values())).kind, sorted(self._joined)
                )
                if error is None:
                    self._remember(requests)
                responses.append(Response(name, requests, error))
            self._warn_stalled(now)
        return responses

    def _remember(self, requests: dict[int, Request]) -> None:
        """Cache a request every rank made identically: later it travels as an integer."""
        first = next(iter(requests.values()))
        same = len(requests) == self.world and all(q == first for q in requests.values())
        if same and first not in self._cache_ids and len(self._cache) < self.cache_capacity:
            self._cache_ids[first] = len(self._cache)
            self._cache.append(first)

    def _warn_stalled(self, now: float) -> None:
        for name, since in self._seen_at.items():
            if now - since > self.stall_s and name not in self._warned:
                self._warned.add(name)
                have = sorted(self._table[name])
                log.warning(
                    "rank %d: collective %r was submitted by ranks %s %.0fs ago; still "
                    "waiting for ranks %s (do all ranks submit the same names?)",
                    self.rank,
                    name,
                    have,
                    now - since,
                    [r for r in range(self.world) if r not in have and r not in self._joined],
                )

    def _local(self, name: str) -> Work | None:
        with self._cv:
            return self._outstanding.get(name)

    def _done(self, name: str, result: Any = None, error: BaseException | None = None) -> None:
        with self._cv:
            work = self._outstanding.pop(name, None)
        if work is None:
            return
        if error is not None:
            work.fail(error)
        else:
            work.finish(result)

    def _finish_join(self) -> None:
        with self._cv:
            if len(self._joined) < self.world:
                return
            last, self._last_joined = self._last_joined, -1
            self._joined.clear()
            work, self._join = self._join, None
            self._join_sent = False
        if work is not None:
            work.finish(last)

    def _fail_all(self, error: HorovodInternalError, broken: bool = False) -> None:
        with self._cv:
            if broken:
                self._broken = error
            works = list(self._outstanding.values())
            self._outstanding.clear()
            self._new.clear()
            join, self._join = self._join, None
        for work in works + ([join] if join is not None else []):
            work.fail(error)


__all__ = [
    "ALLGATHER",
    "ALLREDUCE",
    "ALLTOALL",
    "BARRIER",
    "BROADCAST",
    "MB",
    "REDUCESCATTER",
    "Controller",
    "HorovodInternalError",
    "ReduceOp",
    "Request",
    "Work",
    "env_float",
    "scatter_rows",
]
