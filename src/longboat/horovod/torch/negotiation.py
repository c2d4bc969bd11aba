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
* A ready name whose requests disagree (operation, dtype, shape, reduction, root) fails on every
  rank with ``Mismatched ALLREDUCE tensor shapes ...`` naming the ranks and values: an error
  on every rank, never a hang.
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist

from longboat.collective.buckets import GradSpec, plan_buckets
from longboat.collective.consistency import broadcast_state
from longboat.comm import algorithms
from longboat.comm.exchange import allgather_bytes

log = logging.getLogger("longboat.horovod")

MB = 1024 * 1024
DEFAULT_FUSION_BYTES = 64 * MB
DEFAULT_CYCLE_MS = 1.0
DEFAULT_CACHE_CAPACITY = 1024
DEFAULT_STALL_WARNING_S = 60.0


class HorovodInternalError(RuntimeError):
    """A collective failed: mismatched requests, a dead or stalled peer, or shutdown."""


class ReduceOp(IntEnum):
    """Horovod's reduction ops (same numbering as Horovod's)."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


_TORCH_OPS = {
    ReduceOp.Min: dist.ReduceOp.MIN,
    ReduceOp.Max: dist.ReduceOp.MAX,
    ReduceOp.Product: dist.ReduceOp.PRODUCT,
}

ALLREDUCE, ALLGATHER, BROADCAST = "ALLREDUCE", "ALLGATHER", "BROADCAST"
ALLTOALL, REDUCESCATTER, BARRIER = "ALLTOALL", "REDUCESCATTER", "BARRIER"


@dataclass(frozen=True)
class Request:
    """What one rank asks for under one name; compared across ranks before anything runs."""

    name: str
    kind: str
    dtype: str = ""
    shape: tuple[int, ...] = ()
    device: str = "cpu"
    op: int = int(ReduceOp.Sum)
    prescale: float = 1.0
    postscale: float = 1.0
    root: int = -1
    splits: tuple[int, ...] = ()

    def record(self) -> list[Any]:
        return [
            self.name,
            self.kind,
            self.dtype,
            list(self.shape),
            self.device,
            self.op,
            self.prescale,
            self.postscale,
            self.root,
            list(self.splits),
        ]

    @classmethod
    def from_record(cls, r: Sequence[Any]) -> Request:
        name, kind, dtype, shape, device, op, pre, post, root, splits = r
        return cls(
            str(name),
            str(kind),
            str(dtype),
            tuple(int(s) for s in shape),
            str(device),
            int(op),
            float(pre),
            float(post),
            int(root),
            tuple(int(s) for s in splits),
        )

    @classmethod
    def of(cls, name: str, kind: str, tensor: torch.Tensor | None, **extra: Any) -> Request:
        if tensor is None:
            return cls(name, kind, **extra)
        dtype = str(tensor.dtype).removeprefix("torch.")
        return cls(name, kind, dtype, tuple(tensor.shape), tensor.device.type, **extra)


class Work:
    """One submitted collective on this rank: its request, tensors and eventual result."""

    def __init__(self, request: Request, tensor: torch.Tensor | None, output: Any = None):
        self.request = request
        self.tensor = tensor
        self.output = output
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def finish(self, result: Any) -> None:
        self.result = result
        self.done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()


@dataclass
class Stats:
    """Counters of this rank's negotiation (what the response cache saves is visible here)."""

    cycles: int = 0
    full_requests: int = 0
    cached_requests: int = 0


def _shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _disagreement(what: str, values: dict[int, Any], show: Callable[[Any], str] = str) -> str:
    """'rank 0 sent X, rank 1 sent Y' for ranks whose value differs from the first rank's."""
    first = next(iter(values))
    parts = [f"rank {first} sent {show(values[first])}"]
    parts += [f"rank {r} sent {show(v)}" for r, v in values.items() if v != values[first]]
    return f"{what}: " + ", ".join(parts)


def mismatch(name: str, requests: dict[int, Request]) -> str | None:
    """Why the ranks' requests under ``name`` cannot run together, or None."""
    kinds = {r: q.kind for r, q in requests.items()}
    if len(set(kinds.values())) > 1:
        return _disagreement(f"Mismatched collective operations for {name!r}", kinds)
    kind = next(iter(kinds.values()))
    if kind == BARRIER:
        return None
    checks: list[tuple[str, Callable[[Request], Any], Callable[[Any], str]]] = [
        ("data types", lambda q: q.dtype, str),
        ("devices", lambda q: q.device, str),
    ]
    if kind in (ALLGATHER, ALLTOALL):
        checks.append(("tensor ranks", lambda q: len(q.shape), str))
        checks.append(
            ("tensor shapes (all dimensions but the first)", lambda q: q.shape[1:], _shape)
        )
    else:
        checks.append(("tensor shapes", lambda q: q.shape, _shape))
    if kind in (ALLREDUCE, REDUCESCATTER):
        checks.append(("reduction ops", lambda q: ReduceOp(q.op).name, str))
        checks.append(("prescale factors", lambda q: q.prescale, str))
        checks.append(("postscale factors", lambda q: q.postscale, str))
    if kind == BROADCAST:
        checks.append(("root ranks", lambda q: q.root, str))
    for label, key, show in checks:
        values = {r: key(q) for r, q in requests.items()}
        if len({repr(v) for v in values.values()}) > 1:
            return _disagreement(f"Mismatched {kind} {label} for {name!r}", values, show) + (
                f". Every rank must submit the same {kind.lower()} under one name; "
                "rename one of them or fix the tensor"
            )
    return None


@dataclass
class _Response:
    name: str
    requests: dict[int, Request]
    error: str | None

    @property
    def first(self) -> Request:
        return next(iter(self.requests.values()))


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None


class Controller:
    """The per-rank negotiation thread and the collectives it runs; see the module docstring."""

    def __init__(self, rank: int, world: int, timeout_s: float, algorithm: str = "native"):
        self.rank = rank
        self.world = world
        self.timeout_s = timeout_s
        self.fusion_bytes = int(env_float("HOROVOD_FUSION_THRESHOLD", DEFAULT_FUSION_BYTES))
        self.cycle_s = env_float("HOROVOD_CYCLE_TIME", DEFAULT_CYCLE_MS) / 1000.0
        self.cache_capacity = int(env_float("HOROVOD_CACHE_CAPACITY", DEFAULT_CACHE_CAPACITY))
        self.stall_s = env_float("HOROVOD_STALL_CHECK_TIME_SECONDS", DEFAULT_STALL_WARNING_S)
        wait = timedelta(seconds=timeout_s)
        self.control = dist.new_group(timeout=wait)  # collective: every rank, same order
        self.data = dist.new_group(timeout=wait)
        self._sum = algorithms.make(algorithm, self.data)
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
                raise HorovodInternalError(
                    f"rank {self.rank}: a collective named {name!r} is still in flight on this "
                    "rank; synchronize() it before submitting the name again, or use another name"
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
        return work.result

    def missing_ranks(self, name: str) -> list[int]:
        with self._cv:
            have = self._table.get(name, {})
            return [r for r in range(self.world) if r not in have and r not in self._joined]

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

    def _resolve(self, gathered: list[dict[str, Any]]) -> list[_Response]:
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
                error = mismatch(name, requests)
                if error is None:
                    self._remember(requests)
                responses.append(_Response(name, requests, error))
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

    def _execute(self, responses: list[_Response]) -> None:
        allreduces: dict[tuple[Any, ...], list[_Response]] = {}
        broadcasts: dict[int, list[_Response]] = {}
        for resp in responses:
            q = resp.first
            if resp.error is not None:
                self._done(resp.name, error=HorovodInternalError(resp.error))
            elif q.kind == ALLREDUCE:
                key = (q.dtype, q.device, q.op, q.prescale, q.postscale)
                allreduces.setdefault(key, []).append(resp)
            elif q.kind == BROADCAST:
                broadcasts.setdefault(q.root, []).append(resp)
        for group in allreduces.values():
            self._allreduce(group)
        for root, group in broadcasts.items():
            self._broadcast(root, group)
        for resp in responses:
            if resp.error is None and resp.first.kind not in (ALLREDUCE, BROADCAST):
                getattr(self, "_" + resp.first.kind.lower())(resp)
        self._finish_join()

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

    # -- the collectives -------------------------------------------------------------------------

    def _input(self, resp: _Response) -> torch.Tensor:
        """This rank's tensor for ``resp``; zeros shaped like the others' on a joined rank."""
        work = self._local(resp.name)
        if work is not None and work.tensor is not None:
            return work.tensor
        q = resp.first
        device = torch.device(q.device)
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        shape = q.shape if q.kind != ALLGATHER else (0, *q.shape[1:])
        return torch.zeros(shape, dtype=getattr(torch, q.dtype), device=device)

    def _start_reduce(self, flat: torch.Tensor, op: int) -> Any:
        if op in (ReduceOp.Sum, ReduceOp.Average):
            return self._sum(flat)
        return dist.all_reduce(flat, op=_TORCH_OPS[ReduceOp(op)], group=self.data, async_op=True)

    def _finish_reduce(self, flat: torch.Tensor, q: Request) -> None:
        if q.op == ReduceOp.Average:
            if flat.is_floating_point() or flat.is_complex():
                flat.mul_(q.postscale / self.world)
                return
            flat.div_(self.world, rounding_mode="floor")
        if q.postscale != 1.0:
            flat.mul_(q.postscale)

    def _allreduce(self, group: list[_Response]) -> None:
        """Fused allreduce of responses that share dtype, device, op and scale factors."""
        q = group[0].first
        inputs = [self._input(resp) for resp in group]
        specs = [
            GradSpec(i, resp.name, t.numel(), t.dtype, t.device, resp.name)
            for i, (resp, t) in enumerate(zip(group, inputs, strict=True))
        ]
        cap_mb = max(self.fusion_bytes, 1) / MB
        plan = plan_buckets(
            specs,
            fuse=self.fusion_bytes > 0,
            cap_mb=cap_mb,
            max_layers=len(specs) + 1,
            last_cap_mb=cap_mb,
        )
        launched = []
        for bucket in plan.buckets:
            members = sorted(bucket)
            flat = torch.cat([inputs[i].reshape(-1) for i in members])  # a copy, always
            if q.prescale != 1.0:
                flat.mul_(q.prescale)
            launched.append((members, flat, self._start_reduce(flat, q.op)))
        for members, flat, handle in launched:
            handle.wait()
            self._finish_reduce(flat, q)
            pieces = flat.split([inputs[i].numel() for i in members])
            for i, piece in zip(members, pieces, strict=True):
                work = self._local(group[i].name)
                if work is not None:
                    out = work.output
                    out.copy_(piece.view_as(out))
                    self._done(group[i].name, out)

    def _broadcast(self, root: int, group: list[_Response]) -> None:
        tensors = []
        for resp in group:
            work = self._local(resp.name)
            tensors.append(work.output if work is not None else self._input(resp))
        broadcast_state(tensors, group=self.data, src=root, coalesce=True)
        for resp, tensor in zip(group, tensors, strict=True):
            self._done(resp.name, tensor)

    def _allgather(self, resp: _Response) -> None:
        mine = self._input(resp)
        rows = [resp.requests[r].shape[0] if r in resp.requests else 0 for r in range(self.world)]
        padded = mine.new_zeros((max(rows), *mine.shape[1:]))
        padded[: mine.shape[0]] = mine
        gathered = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(gathered, padded, group=self.data)
        self._done(resp.name, torch.cat([g[:n] for g, n in zip(gathered, rows, strict=True)]))

    def _alltoall(self, resp: _Response) -> None:
        work = self._local(resp.name)
        mine = self._input(resp)
        send = list(resp.requests[self.rank].splits) if work is not None else [0] * self.world
        recv = [
            resp.requests[r].splits[self.rank] if r in resp.requests else 0
            for r in range(self.world)
        ]
        out = mine.new_empty((sum(recv), *mine.shape[1:]))
        dist.all_to_all_single(out, mine.contiguous(), recv, send, group=self.data)
        self._done(resp.name, (out, torch.tensor(recv, dtype=torch.int32)))

    def _reducescatter(self, resp: _Response) -> None:
        q = resp.first
        flat = self._input(resp).reshape(-1).clone()
        if q.prescale != 1.0:
            flat.mul_(q.prescale)
        self._start_reduce(flat, q.op).wait()
        self._finish_reduce(flat, q)
        rows = scatter_rows(q.shape[0], self.world)
        start = sum(rows[: self.rank])
        full = flat.view(q.shape)
        self._done(resp.name, full[start : start + rows[self.rank]].clone())

    def _barrier(self, resp: _Response) -> None:
        self._done(resp.name, None)  # every rank submitted it: that is the barrier

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


def scatter_rows(rows: int, world: int) -> list[int]:
    """Rows of a reducescatter per rank: an even split, the first ranks one more (Horovod)."""
    return [rows // world + (1 if r < rows % world else 0) for r in range(world)]
