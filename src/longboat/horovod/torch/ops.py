"""What every Horovod op shares: integer handles, poll/synchronize, join/barrier, the rules for
``op``/``average`` and process sets, and submission to the negotiation thread.

Every op is submitted by name to the negotiation thread (``negotiation.py``) and returns an
integer handle; ``synchronize(handle)`` waits for the result (bounded by the job timeout) and
raises :class:`HorovodInternalError` with the reason when the op failed. The ops themselves are
in ``reductions.py`` (allreduce, grouped allreduce) and ``scatter_gather.py`` (allgather,
broadcast, alltoall, reducescatter).
"""

from __future__ import annotations

import itertools
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from longboat.horovod.torch import basics
from longboat.horovod.torch.requests import BARRIER, ReduceOp, Request, Work

Average, Sum, Adasum = ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum
Min, Max, Product = ReduceOp.Min, ReduceOp.Max, ReduceOp.Product


class ProcessSet:
    """Horovod's process set; only the global one (every rank) exists here."""

    def __repr__(self) -> str:
        return "ProcessSet(global)"


global_process_set = ProcessSet()


@dataclass
class _Handle:
    works: list[Work]
    grouped: bool = False


_handles: dict[int, _Handle] = {}  # this Horovod session's outstanding ops, by handle
_handles_lock = threading.Lock()
_next_handle = itertools.count()


def reset_handles() -> None:
    """Forget every outstanding handle (``hvd.shutdown``). Numbers keep counting up, so a
    handle kept from an old session can never match a new session's op."""
    with _handles_lock:
        _handles.clear()


def check_process_set(process_set: Any) -> None:
    """Only the global process set exists here."""
    if process_set is not None and process_set is not global_process_set:
        raise NotImplementedError(
            "longboat.horovod runs every op on all ranks: pass no process_set "
            "(hvd.global_process_set)"
        )


def register(works: list[Work], grouped: bool = False) -> int:
    """A new handle for ``works`` (one op, or a group yielding a list)."""
    with _handles_lock:
        handle = next(_next_handle)
        _handles[handle] = _Handle(works, grouped)
    return handle


def resolve_op(op: Any, average: bool | None, stacklevel: int = 3) -> ReduceOp:
    """Horovod's rule: ``op`` supersedes the deprecated ``average``; default Average.

    ``stacklevel`` points the deprecation warning at the user's call (3: the caller's caller).
    """
    if op is not None:
        if average is not None:
            raise ValueError(
                "The op parameter supersedes average. Please provide only one of them."
            )
        chosen = ReduceOp(int(op))
    elif average is not None:
        warnings.warn(
            "Parameter `average` has been replaced with `op` and will be removed",
            DeprecationWarning,
            stacklevel=stacklevel,
        )
        chosen = Average if average else Sum
    else:
        chosen = Average
    if chosen == Adasum:
        raise NotImplementedError(
            "op=hvd.Adasum is not implemented in longboat.horovod; use op=hvd.Average "
            "(the default) or hvd.Sum"
        )
    return chosen


def submit(
    kind: str, tensor: torch.Tensor | None, name: str | None, out: Any, **extra: Any
) -> Work:
    """Queue ``kind`` on ``tensor`` under ``name`` (Horovod's unnamed rule) with ``out``."""
    ctl = basics.controller()
    request = Request.of(ctl.name_for(kind, name), kind, tensor, **extra)
    source = None if tensor is None else tensor.detach()
    return ctl.submit(Work(request, source, out))


# -- control ----------------------------------------------------------------------------------


def poll(handle: int) -> bool:
    """True when ``handle``'s op finished (synchronize() then returns at once)."""
    with _handles_lock:
        entry = _handles.get(handle)
    if entry is None:
        raise ValueError(f"unknown or already synchronized handle {handle!r}")
    return all(w.done.is_set() for w in entry.works)


def synchronize(handle: int) -> Any:
    """Wait for ``handle``'s op and return its output (a list for grouped ops)."""
    with _handles_lock:
        entry = _handles.pop(handle, None)
    if entry is None:
        return None
    ctl = basics.controller()
    results = [ctl.wait(w) for w in entry.works]
    return results if entry.grouped else results[0]


def join(device: int = -1) -> int:
    """Declare this rank done; until every rank joined, it contributes zeros to the others'
    allreduces (empty rows to allgathers). Returns the last rank to join."""
    ctl = basics.controller()
    return int(ctl.wait(ctl.join()))


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank reached a barrier (bounded by the job timeout)."""
    check_process_set(process_set)
    ctl = basics.controller()
    ctl.wait(submit(BARRIER, None, None, None))
