"""What ranks negotiate: the request one rank makes under a name, the check that every rank's
requests under that name can run together, and the work a caller waits on."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch

from longboat.comm.streams import Handoff


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
        """The request as a JSON list (what travels in a cycle's record)."""
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
        """The request a peer sent as :meth:`record`."""
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
        """The request for ``kind`` on ``tensor`` (dtype, shape, device) under ``name``."""
        if tensor is None:
            return cls(name, kind, **extra)
        dtype = str(tensor.dtype).removeprefix("torch.")
        return cls(name, kind, dtype, tuple(tensor.shape), tensor.device.type, **extra)


class Work:
    """One submitted collective on this rank: its request, tensors and eventual result.

    On a GPU the ``handoff`` carries the submitting stream's position (recorded here, in the
    caller's thread) to the negotiation thread, and back a device future completed there on
    its side stream: ``ordered_result`` makes the waiter's stream wait for it.
    """

    def __init__(self, request: Request, tensor: torch.Tensor | None, output: Any = None):
        self.request = request
        self.tensor = tensor
        self.output = output
        self.handoff = Handoff(tensor) if tensor is not None else None
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.owner: Any = None  # the negotiation it was submitted to

    def finish(self, result: Any) -> None:
        """Deliver ``result`` to the waiter (called on the negotiation thread's stream)."""
        self.result = result
        if self.handoff is not None:
            self.handoff.future.set_result(result)  # records the side stream's events
        self.done.set()

    def ordered_result(self) -> Any:
        """The result, with the caller's current stream ordered after the work that wrote it."""
        if self.handoff is not None:
            self.handoff.future.wait()
        return self.result

    def fail(self, error: BaseException) -> None:
        """Deliver ``error`` to the waiter."""
        self.error = error
        self.done.set()


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


_WITH_JOIN = {
    ALLGATHER: "Allgather is not supported with Join at this time. Specify sparse_as_dense=True "
    "if using DistributedOptimizer",
    BROADCAST: "Broadcast is not supported with Join at this time",
    ALLTOALL: "Alltoall is not supported with Join at this time",
    REDUCESCATTER: "Reducescatter is not supported with Join at this time",
}


def join_error(name: str, kind: str, joined: Sequence[int]) -> str | None:
    """Horovod's refusal of ``kind`` while ranks ``joined`` have joined (allreduce and barrier
    go on: a joined rank contributes zeros to an allreduce)."""
    reason = _WITH_JOIN.get(kind)
    if reason is None or not joined:
        return None
    return f"{reason} ({kind.lower()} {name!r}; ranks {sorted(joined)} have called hvd.join())"


@dataclass
class Response:
    """Every rank's request under one ready name, and why they disagree (None: they agree)."""

    name: str
    requests: dict[int, Request]
    error: str | None

    @property
    def first(self) -> Request:
        """The lowest rank's request."""
        return next(iter(self.requests.values()))


def scatter_rows(rows: int, world: int) -> list[int]:
    """Rows of a reducescatter per rank: an even split, the first ranks one more (Horovod)."""
    return [rows // world + (1 if r < rows % world else 0) for r in range(world)]
