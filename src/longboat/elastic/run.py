"""``lb.elastic.run``: call a training function again after every membership change."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

import longboat.cluster as cluster
from longboat.elastic import join, world
from longboat.elastic.failures import describe, is_peer_failure
from longboat.elastic.membership import ElasticError, Membership
from longboat.elastic.recovery import StateLostError
from longboat.elastic.state import State
from longboat.log import get_logger

_log = get_logger("longboat.elastic")
#: Membership changes in a row without a commit between them before the job gives up.
MAX_RESETS_WITHOUT_PROGRESS = 5

T = TypeVar("T")


def run(train: Callable[..., T]) -> Callable[..., T]:
    """Decorate ``train(state, ...)`` so that it survives ranks leaving and joining.

    The first call syncs the state (a rank that joined late receives it). When a peer fails,
    every surviving rank rolls back to its last ``state.commit()``, its launcher forms a new
    rendezvous round, longboat rebuilds the process group and the model's reducer for the new
    world, the reset callbacks run, the state is synced and ``train(state, ...)`` is called
    again. A node that joins is admitted at the next commit the same way (without a rollback).
    Outside an elastic job (no ``longboat launch --nnodes MIN:MAX``) this just calls ``train``.
    """

    @functools.wraps(train)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> T:
        if not world.is_elastic():
            return train(state, *args, **kwargs)
        if not cluster.is_initialized():  # lb.init() not called: join the round at least
            cluster.init(startup=join.startup())
        resets, last_commits = 0, state.commits
        lost_in_sync = _first_sync(state)  # a peer lost while the state moved: rejoin
        while True:
            if lost_in_sync:
                lost, reason, lost_in_sync = True, lost_in_sync, ""
            else:
                try:
                    return train(state, *args, **kwargs)
                except world.MembershipChanged as exc:
                    lost, reason = False, str(exc)
                except Exception as exc:
                    if not is_peer_failure(exc):
                        raise
                    lost, reason = True, describe(exc)
                    state.restore()
            began = time.monotonic()
            resets = resets + 1 if state.commits == last_commits else 1
            last_commits = state.commits
            if resets > MAX_RESETS_WITHOUT_PROGRESS:
                raise ElasticError(
                    f"{resets - 1} membership changes without a committed step in between; "
                    f"last: {reason}"
                )
            _log.warning(
                "rank %d: %s; %s commit %d and waiting for the new membership",
                cluster.rank(),
                reason,
                "rolled back to" if lost else "keeping",
                state.commits,
            )
            membership, source = _rejoin(state, reason, lost)
            _log.warning(
                "rank %d of %d after the change (%s); state of rank %d, commit %d, %.2f s",
                cluster.rank(),
                membership.world_size,
                membership.reason,
                source,
                state.commits,
                time.monotonic() - began,
            )
            if lost:
                state.recovering_since(began)

    return wrapper


def _first_sync(state: State) -> str:
    """The job's first `State.sync` on this rank; '' when done, else why a peer was lost
    meanwhile (the rank rolls back and joins the next round, as after any lost peer)."""
    try:
        _sync(state)
    except Exception as exc:
        if not is_peer_failure(exc):
            raise
        state.restore()
        return describe(exc)
    return ""


def _sync(state: State) -> int:
    """`State.sync`; when every copy of the state is lost, tell the launcher not to restart
    this rank (starting again cannot bring the state back) before raising."""
    try:
        return state.sync()
    except StateLostError as exc:
        world.stop_job(str(exc))
        raise


def _rejoin(state: State, reason: str, lost: bool) -> tuple[Membership, int]:
    """Join the next round, rebuild for it and hand the state around; return the round and
    the rank whose state everyone took. A peer lost on the way (a member of the new round
    died or left it) rolls back and starts over with the round after."""
    for _ in range(MAX_RESETS_WITHOUT_PROGRESS):
        membership = world.regroup(reason, lost_peer=lost, strategy=cluster.current_strategy())
        try:
            state.on_reset()
            return membership, _sync(state)
        except Exception as exc:
            if not is_peer_failure(exc):
                raise
            reason, lost = describe(exc), True
            state.restore()
            _log.warning(
                "rank %d: %s while joining round %s", cluster.rank(), reason, membership.token
            )
    raise ElasticError(
        f"{MAX_RESETS_WITHOUT_PROGRESS} rounds in a row failed while being joined; last: {reason}"
    )
