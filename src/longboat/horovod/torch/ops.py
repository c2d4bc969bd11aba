"""What every Horovod op shares: integer handles, poll/synchronize, join/barrier, the rules for
``op``/``average`` and process sets, and submission to the negotiation thread.

Every op is submitted by name to the negotiation thread (``negotiation.py``) and returns an
integer handle; ``synchronize(handle)`` waits for the result (bounded by the job timeout) and
raises :class:`HorovodInternalError` with the reason when the op failed. The ops themselves are
in ``reductions.py`` (allreduce, grouped allreduce), ``scatter_gather.py`` (allgather,
broadcast, alltoall, reducescatter, their grouped forms) and ``sparse.py``. An op with
``process_set=`` goes to that set's negotiation (``process_sets.py``).
"""

from __future__ import annotations

import itertools
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from longboat.horovod.torch import basics
from longboat.horovod.torch.dtypes import check_dtype
from longboat.horovod.torch.negotiation import Controller
from longboat.horovod.torch.process_sets import ProcessSet, controller_for, global_process_set
from longboat.horovod.torch.requests import BARRIER, ReduceOp, Request, Work

Average, Sum, Adasum = ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum
Min, Max, Product = ReduceOp.Min, ReduceOp.Max, ReduceOp.Product


@dataclass
class _Handle:
    works: list[Work]
    controller: Controller
    grouped: bool = False


_handles: dict[int, _Handle] = {}  # this Horovod session's outstanding ops, by handle
_handles_lock = threading.Lock()
_next_handle = itertools.count()


def reset_handles() -> None:
    """Forget every outstanding handle (``hvd.shutdown``). Numbers keep counting up, so a
    handle kept from an old session can never match a new session's op."""
    with _handles_lock:
        _handles.clear()


def controller(process_set: ProcessSet | None = None) -> Controller:
    """The negotiation running ops of ``process_set`` on this rank (ValueError before init,
    for an unregistered set or on a rank outside it)."""
    return controller_for(process_set, basics.controller())


def set_size(process_set: ProcessSet | None) -> int:
    """Number of ranks in ``process_set`` (every rank for the global set)."""
    return controller(process_set).world


def set_rank(process_set: ProcessSet | None) -> int:
    """This rank's position in ``process_set``."""
    return controller(process_set).rank


def register(works: list[Work], grouped: bool = False) -> int:
    """A new handle for ``works`` (one op, or a group yielding a list), all submitted to
    one process set's negotiation."""
    ctl = works[0].owner if works and works[0].owner is not None else basics.controller()
    with _handles_lock:
        handle = next(_next_handle)
        _handles[handle] = _Handle(works, ctl, grouped)
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
    kind: str,
    tensor: torch.Tensor | None,
    name: str | None,
    out: Any,
    process_set: ProcessSet | None = None,
    **extra: Any,
) -> Work:
    """Queue ``kind`` on ``tensor`` under ``name`` (Horovod's unnamed rule) with ``out``, on
    ``process_set``'s negotiation."""
    ctl = controller(process_set)
    if tensor is not None:
        check_dtype(tensor, kind.lower())
    request = Request.of(ctl.name_for(kind, name), kind, tensor, **extra)
    source = None if tensor is None else tensor.detach()
    work = Work(request, source, out)
    work.owner = ctl
    return ctl.submit(work)


# -- control ----------------------------------------------------------------------------------


def poll(handle: int) -> bool:
    """True when ``handle``'s op finished (synchronize() then returns at once)."""
    with _handles_lock:
        entry = _handles.get(handle)
    if entry is None:
        raise ValueError(f"unknown or already synchronized handle {handle!r}")
    return all(w.done.is_set() for w in entry.works)


def synchronize(handle: Any) -> Any:
    """Wait for ``handle``'s op and return its output (a list for grouped ops). A callable
    handle (``sparse_allreduce_async``) is called."""
    if callable(handle):
        return handle()
    with _handles_lock:
        entry = _handles.pop(handle, None)
    if entry is None:
        return None
    results = [entry.controller.wait(w) for w in entry.works]
    return results if entry.grouped else results[0]


def join(device: int = -1) -> int:
    """Declare this rank done; until every rank joined, it contributes zeros to the others'
    allreduces (allgather, broadcast, alltoall and reducescatter raise meanwhile, as in
    Horovod). Returns the last rank to join."""
    ctl = basics.controller()
    return int(ctl.wait(ctl.join()))


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank of ``process_set`` reached a barrier (bounded by the job timeout)."""
    controller(process_set).wait(submit(BARRIER, None, None, None, process_set))
