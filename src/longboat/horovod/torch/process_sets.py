"""Horovod's process sets on torch process groups.

A :class:`ProcessSet` is a sorted list of global ranks. Registered (``hvd.init(process_sets=
[...])``, or ``hvd.add_process_set`` after ``hvd.init(process_sets="dynamic")`` or with
``HOROVOD_DYNAMIC_PROCESS_SETS=1``), it gets an id and two process groups over its ranks
(``dist.new_group``: control and data), and each member runs its own negotiation thread for
the set. Ops with ``process_set=`` are negotiated and run among the set's members only.

Horovod's rule, checked here: registering and removing process sets is collective over *every*
rank, members or not, in the same order with the same ranks (torch's ``new_group`` has the same
rule). Each registration first compares the request across ranks (an allgather on the job's
process group) and raises ``ValueError`` on every rank when they differ, instead of hanging.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from longboat.comm.exchange import allgather_bytes
from longboat.comm.groups import make_communicators

if TYPE_CHECKING:
    from longboat.horovod.torch.negotiation import Controller


class ProcessSet:
    """A set of ranks that run collectives together (Horovod's ``hvd.ProcessSet``)."""

    def __init__(self, ranks_or_comm: Iterable[int]):
        if isinstance(ranks_or_comm, (str, bytes)) or not isinstance(ranks_or_comm, Iterable):
            raise ValueError(
                "ProcessSet should be initialized with a list of process ranks (longboat runs "
                "without MPI, so mpi4py communicators are not accepted)"
            )
        ranks = list(ranks_or_comm)
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError("ProcessSet should be initialized with a list of process ranks")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ProcessSet ranks {ranks} contain duplicates")
        self.ranks: list[int] | None = sorted(ranks)
        self.process_set_id: int | None = None
        self.controller: Controller | None = None  # this rank's negotiation, when a member
        self.groups: tuple[Any, ...] = ()  # (control, data, gradients) on every rank

    def size(self) -> int | None:
        """Number of ranks in the set; None before it is registered."""
        if self.process_set_id is None or not dist.is_initialized():
            return None
        if self is global_process_set:
            return dist.get_world_size()
        assert self.ranks is not None
        return len(self.ranks)

    def rank(self) -> int | None:
        """This process's rank within the set (-1 outside it); None before registration.

        Ops such as ``broadcast(root_rank=...)`` still take *global* ranks, as in Horovod.
        """
        if self.process_set_id is None or not dist.is_initialized():
            return None
        me = dist.get_rank()
        members = self.members()
        return members.index(me) if me in members else -1

    def included(self) -> bool | None:
        """Whether this process belongs to the set; None before registration."""
        if self.process_set_id is None or not dist.is_initialized():
            return None
        return dist.get_rank() in self.members()

    def members(self) -> list[int]:
        """The set's global ranks (every rank for the global set)."""
        if self is global_process_set:
            return list(range(dist.get_world_size()))
        assert self.ranks is not None
        return list(self.ranks)

    def invalidate(self) -> None:
        """Forget the registration (after remove_process_set or shutdown)."""
        self.process_set_id = None
        self.controller = None
        self.groups = ()

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])
global_process_set.ranks = None
global_process_set.process_set_id = 0

_registered: dict[int, ProcessSet] = {}  # id -> set, the global one excluded
_next_id = 1
_dynamic = False


def dynamic_enabled() -> bool:
    """Whether add/remove_process_set may be called (``process_sets="dynamic"`` or env)."""
    return _dynamic or os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "") not in ("", "0")


def _agree(action: str, ranks: list[int] | None) -> None:
    """Every rank must make the same registration call at this point; ValueError otherwise."""
    if dist.get_world_size() == 1:
        return
    mine = json.dumps([action, ranks]).encode()
    everyone = [json.loads(b) for b in allgather_bytes(mine)]
    if any(e != everyone[0] for e in everyone):
        calls = ", ".join(f"rank {r}: {a}({s})" for r, (a, s) in enumerate(everyone))
        raise ValueError(
            "process sets must be added and removed by every rank (members or not) in the "
            f"same order with the same ranks; this call differs across ranks: {calls}"
        )


def register(process_set: ProcessSet, start: Any) -> ProcessSet:
    """Give ``process_set`` an id and its groups (collective over every rank); members get a
    negotiation thread from ``start(rank_in_set, size, (control, data))``."""
    global _next_id
    if process_set is global_process_set or process_set.process_set_id is not None:
        raise ValueError(f"{process_set} is already registered")
    assert process_set.ranks is not None
    world = dist.get_world_size()
    _agree("add_process_set", process_set.ranks)
    bad = [r for r in process_set.ranks if not 0 <= r < world]
    if not process_set.ranks or bad:
        raise ValueError(
            f"process set ranks {process_set.ranks} must be a non-empty list of ranks in "
            f"0..{world - 1}"
        )
    for other in _registered.values():
        if other.ranks == process_set.ranks:
            raise ValueError(
                f"a process set with ranks {process_set.ranks} is already registered "
                f"(id {other.process_set_id})"
            )
    if process_set.ranks == list(range(world)):
        raise ValueError(f"ranks {process_set.ranks} are every rank: use hvd.global_process_set")
    groups = tuple(make_communicators(3, process_set.ranks))
    process_set.groups = groups
    process_set.process_set_id = _next_id
    _next_id += 1
    me = dist.get_rank()
    if me in process_set.ranks:
        process_set.controller = start(
            process_set.ranks.index(me), len(process_set.ranks), groups[:2]
        )
    _registered[process_set.process_set_id] = process_set
    return process_set


def unregister(process_set: ProcessSet) -> bool:
    """Stop the set's negotiation and forget it (collective over every rank); False for the
    global set or an unknown one."""
    if process_set is global_process_set or process_set.process_set_id is None:
        return False
    _agree("remove_process_set", process_set.ranks)
    _registered.pop(process_set.process_set_id, None)
    _close(process_set)
    return True


def _close(process_set: ProcessSet) -> None:
    ctl = process_set.controller
    if ctl is not None:
        ctl.close(grace_s=5.0)
    for group in process_set.groups[2:]:
        _destroy(group)
    process_set.invalidate()


def _destroy(group: Any) -> None:
    if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
        return
    with contextlib.suppress(Exception):  # teardown of a group that may already be gone
        dist.destroy_process_group(group)


def close_all() -> None:
    """Forget every registered set (``hvd.shutdown``)."""
    global _next_id, _dynamic
    for process_set in list(_registered.values()):
        _close(process_set)
    _registered.clear()
    _next_id = 1
    _dynamic = False


def set_dynamic(enabled: bool) -> None:
    global _dynamic
    _dynamic = enabled


def registered() -> list[ProcessSet]:
    """The registered sets, the global one first."""
    return [global_process_set, *(_registered[k] for k in sorted(_registered))]


def controller_for(process_set: ProcessSet | None, default: Controller) -> Controller:
    """The negotiation that runs ops of ``process_set`` on this rank (ValueError when the set
    is unknown or this rank is not a member, as Horovod)."""
    if process_set is None or process_set is global_process_set:
        return default
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"process_set must be a hvd.ProcessSet, got {type(process_set).__name__}")
    if process_set.process_set_id is None:
        raise ValueError(
            f"{process_set} is not registered: pass it to hvd.init(process_sets=[...]) or "
            "hvd.add_process_set() on every rank first"
        )
    if process_set.controller is None:
        raise ValueError(
            f"rank {dist.get_rank()} is not part of {process_set}: only its members may run "
            "collectives on it"
        )
    return process_set.controller
