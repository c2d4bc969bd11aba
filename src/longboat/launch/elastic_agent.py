"""torch's elastic agent for ``--nnodes MIN:MAX``: membership changes without restarting ranks.

torch's own agent stops and restarts every rank when the c10d rendezvous changes (a node lost
or added), so training resumes from the last checkpoint on disk. `ElasticAgent` runs the same
rendezvous rounds but keeps the running ranks: after each round it publishes the new ranks,
world size and store to them (`longboat.elastic.membership`), and `longboat.elastic.run` in
each rank rolls back to its last in-memory commit, re-forms the process group and goes on. A
new round starts when a node waits to join (torch's ``num_nodes_waiting``) or when a rank of
this node asks for one because it lost a peer. Only this node's own failed ranks are
restarted (as newcomers that receive the state from a survivor), as ``--max-restarts``
allows; without restarts left the node leaves and the others go on.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.elastic.agent.server.api import (
    DEFAULT_ROLE,
    RunResult,
    WorkerGroup,
    WorkerState,
)
from torch.distributed.elastic.multiprocessing import SignalException

from longboat.cluster.env import variable
from longboat.elastic.failures import describe
from longboat.elastic.membership import (
    Membership,
    acknowledged,
    regroup_requests,
    stop_reason,
    write_membership,
)
from longboat.launch.rendezvous import (
    POLL_S,
    STORE_READ_TIMEOUT_S,
    lost_participants,
    rendezvous_closed,
    synced_round,
)
from longboat.launch.store_watchdog import StoreWatchdog
from longboat.launch.supervisor import WatchedAgent

_TOKEN_KEY = "longboat/round-token"
_NODE_KEY = "longboat/node/"
_EXIT_KEY = "longboat/exit/"


def exit_barrier(
    store: Any,
    size: int,
    gone: Callable[[], str],
    timeout: float,
    bounded: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    poll: float = POLL_S,
) -> str:
    """Check in at the exit barrier of a round of ``size`` nodes (``store``: the round's) and
    wait for the others: '' once all checked in, else why the wait ended early: ``gone()``'s
    reason (polled between short store calls, each under ``bounded()``), or the timeout.

    It sleeps in Python between polls, so a signal handler runs at once.
    """
    arrived, everyone = f"{_EXIT_KEY}arrived", f"{_EXIT_KEY}everyone"
    with bounded():
        if store.add(arrived, 1) >= size:
            store.set(everyone, "1")
    deadline = time.monotonic() + timeout
    while True:
        with bounded():
            if store.check([everyone]):
                return ""
        reason = gone()
        if reason:
            with bounded():  # the last one may have checked in meanwhile
                return "" if store.check([everyone]) else reason
        if time.monotonic() > deadline:
            return f"not every node finished within {timeout:.0f} s"
        time.sleep(poll)


@dataclass(frozen=True)
class MembershipChange:
    """A rendezvous round that changed the job's members, as the console reports it."""

    membership: Membership
    old_world_size: int
    seconds: float


class ElasticAgent(WatchedAgent):
    """`WatchedAgent` whose ranks outlive rendezvous rounds (see the module docstring)."""

    def __init__(
        self,
        *args: Any,
        elastic_dir: Path,
        store_endpoint: str,
        node_address: str,
        on_change: Callable[[MembershipChange], None] | None = None,
        on_note: Callable[[str], None] | None = None,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self._dir = elastic_dir
        self._endpoint = store_endpoint
        self._address = node_address
        self._on_change = on_change
        self._on_note = on_note
        self._ack_deadline: float | None = None
        self._membership: Membership | None = None
        self._reason = "start"
        self._round: int | None = None
        self._store_watch = StoreWatchdog(2 * STORE_READ_TIMEOUT_S, self._lost_store)

    @staticmethod
    def _ack_timeout() -> float:
        """Twice the ranks' failure timeout: a rank mid-step reaches its next commit first."""
        return 2 * variable("LONGBOAT_TIMEOUT", default=30.0)

    @property
    def membership(self) -> Membership | None:
        """The round published last."""
        return self._membership

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        super()._rendezvous(worker_group)
        self._round = synced_round(worker_group.spec.rdzv_handler)
        self._publish(worker_group)

    def _publish(self, worker_group: WorkerGroup) -> None:
        """Share a token and the nodes' addresses in the round's store; write membership."""
        store = worker_group.store
        rank, size = worker_group.group_rank, worker_group.group_world_size
        with self._store_watch.bounded():
            store.set(f"{_NODE_KEY}{rank}", self._address)
            if rank == 0:
                store.set(_TOKEN_KEY, uuid.uuid4().hex[:12])
            token = store.get(_TOKEN_KEY).decode()
            nodes = [store.get(f"{_NODE_KEY}{r}").decode() for r in range(size)]
        before = self._membership.nodes if self._membership else []
        membership = Membership(
            token=token,
            world_size=worker_group.workers[0].world_size,
            group_rank=rank,
            group_world_size=size,
            ranks={w.local_rank: w.global_rank for w in worker_group.workers},
            store=self._endpoint,
            nodes=nodes,
            left=[n for n in before if n not in nodes],
            joined=[n for n in nodes if before and n not in before],
            reason=self._reason,
        )
        write_membership(self._dir, membership)
        self._membership = membership

    def _invoke_run(self, role: str = DEFAULT_ROLE) -> RunResult:
        group = self._worker_group
        spec = group.spec
        self._initialize_workers(group)
        while True:
            time.sleep(spec.monitor_interval)
            result = self._monitor_workers(group)
            group.state = result.state
            if result.state == WorkerState.SUCCEEDED:
                self._exit_barrier()
                return result
            if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
                stop = stop_reason(self._dir)
                if stop and self._on_note is not None:  # a restart cannot help: say why, once
                    self._on_note(f"the job stops: {stop}")
                if self._remaining_restarts > 0 and not stop:
                    self._remaining_restarts -= 1
                    self._reason = "ranks of this node failed and were restarted"
                    self._restart_workers(group)
                    continue
                self._stop_workers(group)
                group.state = WorkerState.FAILED
                return result
            self._stop_ranks_that_did_not_follow(group)
            reason = self._regroup_reason(spec.rdzv_handler)
            if reason:
                self._regroup(group, reason)

    def _stop_ranks_that_did_not_follow(self, group: WorkerGroup) -> None:
        """A rank that has not taken up a new round within twice the failure timeout after it
        was published is hung (it would stall every round): kill it, so that it fails and is
        restarted or its node leaves."""
        if self._ack_deadline is None or self._membership is None:
            return
        missing = set(self._membership.ranks) - acknowledged(self._dir, self._membership.token)
        if not missing:
            self._ack_deadline = None
        elif time.monotonic() > self._ack_deadline:
            self._ack_deadline = None
            for worker in group.workers:
                if worker.local_rank in missing and worker.id is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(worker.id), signal.SIGKILL)
            if self._on_note is not None:
                ranks = sorted(self._membership.ranks[r] for r in missing)
                self._on_note(
                    f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} did not "
                    f"join round {self._membership.token} within {self._ack_timeout():.0f} s "
                    "(hung?): killed"
                )

    def _regroup_reason(self, handler: Any) -> str:
        """Why a new round is due now ('' when none is)."""
        if self._membership is not None:
            asked = regroup_requests(self._dir, self._membership.token)
            if asked:
                return f"a rank lost its peers ({asked[0]})"
        with self._store_watch.bounded():
            waiting = handler.num_nodes_waiting()  # also syncs the rendezvous state
        if waiting:
            return f"{waiting} node{'s' if waiting != 1 else ''} waiting to join"
        if self._membership is not None:
            lost = lost_participants(handler, self._membership.group_world_size)
            if lost:
                return (
                    f"{lost} node{'s' if lost != 1 else ''} of this round gone from the "
                    "rendezvous (left it, or heartbeats stopped)"
                )
        if synced_round(handler) not in (None, self._round):
            # our heartbeats came late and the others went on to a new round without us
            return "the rendezvous moved on to a new round"
        return ""

    def _exit_barrier(self) -> None:
        """Wait for the other nodes of this round to finish (see `exit_barrier`). When the wait
        ends without them, say why and leave the rendezvous open for the nodes that go on."""
        group = self._worker_group
        handler = group.spec.rdzv_handler
        self._in_exit_barrier = True  # torch's health check reads it
        try:
            reason = exit_barrier(
                self._store,
                group.group_world_size,
                lambda: self._peers_gone(handler, group.group_world_size),
                self._exit_barrier_timeout,
                self._store_watch.bounded,
            )
        except SignalException:
            raise
        except Exception as exc:  # the store's host is gone: so is everyone's rendezvous
            reason = f"the rendezvous store failed ({describe(exc)})"
        finally:
            self._in_exit_barrier = False
        if not reason:
            return
        if hasattr(handler, "leave_open"):
            handler.leave_open()
        if self._on_note is not None:
            token = self._membership.token if self._membership is not None else "?"
            self._on_note(
                f"this node's ranks finished, but the other nodes of round {token} did not "
                f"finish with them ({reason}); not waiting for them"
            )

    def _peers_gone(self, handler: Any, size: int) -> str:
        """Why a node of this round can no longer reach the exit barrier ('' if none)."""
        with self._store_watch.bounded():
            handler.num_nodes_waiting()  # syncs the rendezvous state
        if rendezvous_closed(handler):
            return "the rendezvous was closed: the job finished without this node"
        lost = lost_participants(handler, size)
        if lost:
            return f"{lost} node{'s' if lost != 1 else ''} of the round left the rendezvous"
        if synced_round(handler) not in (None, self._round):
            return "the rendezvous moved on to a round without this node"
        return ""

    def _lost_store(self, seconds: float) -> None:
        """The rendezvous store stopped answering (this node's link is gone): the others have
        gone on without this node, so stop its ranks and end the launcher (exit code 1)."""
        if self._on_note is not None:
            self._on_note(
                f"the rendezvous store at {self._endpoint} did not answer for {seconds:.0f} s "
                "(this node's network is gone?): stopping this node's ranks"
            )
        for worker in self._worker_group.workers:
            if worker.id is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(worker.id), signal.SIGKILL)
        os._exit(1)

    def _regroup(self, group: WorkerGroup, reason: str) -> None:
        """Join the next round with the ranks still running, and publish it to them."""
        began = time.monotonic()
        old_world = group.workers[0].world_size
        pids = {w.local_rank: w.id for w in group.workers}
        self._reason = reason
        try:
            self._rendezvous(group)
        except BaseException:
            self._stop_workers(group)
            raise
        for worker in group.workers:
            worker.id = pids[worker.local_rank]  # the same processes, with their new ranks
        self._watch_workers(group, pids)
        if self._ack_deadline is None:  # a rank still missing keeps its first deadline
            self._ack_deadline = time.monotonic() + self._ack_timeout()
        if self._on_change is not None and self._membership is not None:
            self._on_change(MembershipChange(self._membership, old_world, time.monotonic() - began))


def elastic_directory(log_dir: str) -> Path:
    """Where a node's launcher and ranks exchange membership files."""
    return Path(os.path.abspath(log_dir)) / ".elastic"
