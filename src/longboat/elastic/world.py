"""A rank's side of membership changes: notice them, leave the old process group, join the
new round its launcher published (`longboat.elastic.membership`)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch.distributed as dist

import longboat.cluster as cluster
from longboat.cluster.env import variable
from longboat.cluster.runtime import ClusterError
from longboat.comm.exchange import any_rank
from longboat.elastic.failures import describe, is_peer_failure
from longboat.elastic.forming import abandoned_when_replaced
from longboat.elastic.lost_links import leave_round
from longboat.elastic.membership import (
    ElasticError,
    Membership,
    elastic_dir,
    highest_commits,
    read_membership,
    request_regroup,
    require_elastic_dir,
    write_ack,
    write_commits,
    write_stop,
)
from longboat.log import get_logger

if TYPE_CHECKING:
    from longboat.strategy import Strategy

_log = get_logger("longboat.elastic")
_POLL_S = 0.05
T = TypeVar("T")


class MembershipChanged(Exception):
    """Raised by ``State.commit`` when a node joined or left: every rank leaves at the same
    commit and ``lb.elastic.run`` moves the job to the new round."""


_survivor = False  # this process went through a membership change with its state


def survivor() -> bool:
    """True once this rank moves to a new round keeping its state (not a newcomer): its
    place in the round says so (``ClusterInfo.carries_state``)."""
    return _survivor


def is_elastic() -> bool:
    """True in a rank started by ``longboat launch --nnodes MIN:MAX``."""
    return elastic_dir() is not None


def joined_round() -> Membership | None:
    """The round this rank's process group belongs to (None before init or outside elastic)."""
    if not cluster.is_initialized():
        return None
    return cluster.cluster().elastic_round


def change_pending() -> bool:
    """Collective: has any rank's launcher published a newer round? Every rank gets the same
    answer, so all leave at the same commit."""
    mine = joined_round()
    if mine is None or not dist.is_initialized():
        return False
    published = read_membership(require_elastic_dir())
    return any_rank(published is not None and published.token != mine.token)


def record_commits(commits: int) -> None:
    """Tell the launcher (and ``longboat emulate``) how many steps this rank committed."""
    directory = elastic_dir()
    if directory is not None:
        write_commits(directory, cluster.local_rank(), commits)


def recorded_commits() -> int:
    """The highest commit count the ranks of this node recorded in this job (-1: none, or
    not an elastic job)."""
    directory = elastic_dir()
    return highest_commits([directory]) if directory is not None else -1


def stop_job(reason: str) -> None:
    """Tell this rank's launcher that the job ends here on purpose (no restart helps)."""
    directory = elastic_dir()
    if directory is not None:
        write_stop(directory, cluster.local_rank(), reason)


def regroup(reason: str, lost_peer: bool, strategy: Strategy | None = None) -> Membership:
    """Leave the current process group and join the next round; return it.

    ``lost_peer``: this rank saw a peer fail, so it asks its launcher for a new round unless
    one was already published. Waits are bounded by the launch timeout.
    """
    global _survivor
    old = joined_round()
    _leave(close_connections=lost_peer)
    _survivor = True  # joins the round with its state
    start = functools.partial(cluster.init, strategy)  # with the startup lb.init handed down
    return _form(start, old.token if old is not None else "", lost_peer, reason)[0]


def join(start: Callable[[], T]) -> T:
    """Form this rank's first process group of an elastic job: ``start()`` (``lb.init``'s
    group start) in the round its launcher published last. When that fails because a member
    died or restarted meanwhile, the rank asks for the next round and forms its group there,
    as a survivor does, within the launch timeout."""
    current = read_membership(require_elastic_dir())
    if current is None:
        return start()  # it says why: no round was published yet
    return _form(start, "", lost_peer=False, reason="", first=current)[1]


def _form(
    start: Callable[[], T],
    old_token: str,
    lost_peer: bool,
    reason: str,
    first: Membership | None = None,
) -> tuple[Membership, T]:
    """Form the process group (``start()``) in ``first``, else in the next round after
    ``old_token``; a round that does not form (a member died, hung or moved on meanwhile) is
    left for the one after. Bounded by the launch timeout; each attempt by the failure timeout,
    and abandoned at once when a newer round is published."""
    directory = require_elastic_dir()
    local_rank = cluster.local_rank()
    give_up = time.monotonic() + _launch_timeout()
    while time.monotonic() < give_up:
        if first is not None:
            membership, first = first, None
        else:
            published = read_membership(directory)
            if lost_peer and (published is None or published.token == old_token):
                request_regroup(directory, local_rank, old_token, reason)
            membership = _wait_for_round(directory, old_token)
            write_ack(directory, local_rank, membership.token)  # alive and following: not hung
        try:
            _restart_group_names()
            with abandoned_when_replaced(directory, membership.token, membership.store):
                return membership, start()
        except Exception as exc:
            if not _did_not_form(exc):
                raise
            # a member died, hung or restarted meanwhile
            _log.warning(
                "round %s did not form (%s); asking for another", membership.token, describe(exc)
            )
            _leave(close_connections=True)
            old_token, lost_peer, reason = membership.token, True, describe(exc)
    raise ElasticError(f"no round formed within {_launch_timeout():.0f} s; last: {reason}")


def _did_not_form(exc: BaseException) -> bool:
    """Did the group fail to form for want of a member (a lost peer, a store or connection
    wait that timed out), rather than from a setting that another round cannot change?"""
    caused = isinstance(exc, ClusterError) and exc.__cause__ is not None
    return caused or is_peer_failure(exc)


def _restart_group_names() -> None:
    """Name the next default process group as a fresh process would.

    torch names default groups by a per-process count, part of every key the group's ranks
    meet under in the store; `destroy_process_group` resets it, but an attempt that failed
    (a member died while the round formed) counts one without a group to destroy. A survivor
    that saw such a failure would then wait under other keys than the ranks restarted meanwhile,
    and no round would ever form."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and not dist.is_initialized():
        world.group_count = 0


def _launch_timeout() -> float:
    """How long joining a round may take in all (the launcher's --timeout)."""
    return float(variable("LONGBOAT_LAUNCH_TIMEOUT", default=300.0))


def _leave(close_connections: bool) -> None:
    """Drop the old process group and everything longboat made for it.

    After a peer failure (``close_connections``) this rank's connections of the round are
    shut down first, and the groups are aborted: a peer still waiting in a collective with
    this rank fails now instead of at the failure timeout (Gloo keeps a context's connections
    open while a collective of it is pending). A planned change (a node joined) leaves at a
    commit every rank reached, and closes nothing early: a peer may still be finishing the
    last collective with this rank.
    """
    if close_connections:
        closed = leave_round()
        if closed:
            _log.info("closed %d connection(s) of the old round", closed)
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None and dist.is_initialized():
        try:
            abort()
        except Exception as exc:  # torch builds without abort support: the timeout still ends it
            _log.warning("aborting the old process group: %s", describe(exc))
    try:
        cluster.shutdown()
    except Exception as exc:  # a broken group may fail to tear down cleanly: it is gone anyway
        _log.warning("leaving the old process group: %s", describe(exc))


def _wait_for_round(directory: Path, old_token: str) -> Membership:
    timeout = _launch_timeout()
    deadline = time.monotonic() + timeout
    while True:
        membership = read_membership(directory)
        if membership is not None and membership.token != old_token:
            return membership
        if time.monotonic() > deadline:
            raise ElasticError(
                f"no new membership from the launcher within {timeout:.0f}s (is fewer than "
                "--nnodes MIN alive? see the launcher's console)"
            )
        time.sleep(_POLL_S)
