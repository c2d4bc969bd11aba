"""Sync-mode trainers riding out a parameter server's restart by themselves.

A trainer keeps what it pushed for its last ``window`` steps: the dense gradients (and
learning rates) and the row gradients of every sparse table (the ids it looked up and one
gradient row per id). When a call fails because a server died (or a restarted server refuses
a step it lost), it waits (bounded) until that server answers again as a new process restored
from its checkpoint, rolls every server back to that checkpoint's step (``PSEngine.restore``:
a barrier of all trainers, then each server reloads its file) and pushes its logged gradients
again, step by step. The servers recompute the same updates from the same gradients (sparse
rows included: admission counts and optimizer state come back with the checkpoint, and
probability admission is a pure function of the table's seed and the id), so no update since
the checkpoint is lost: the training loop goes on as if nothing had happened.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from longboat.log import get_logger
from longboat.ps.shared.wire import Message
from longboat.ps.trainer import table_admin
from longboat.ps.trainer.client import Client, PSError
from longboat.ps.trainer.params import DenseParams, wait_all
from longboat.ps.trainer.sparse import RowGrads, SparseLookups

log = get_logger("longboat.ps")

RESTART_WAIT_ENV = "LONGBOAT_PS_RESTART_WAIT"
DEFAULT_RESTART_WAIT_S = 120.0
#: gRPC codes of a server that is gone (or came back as a new process that lost our step)
_SERVER_GONE = {"UNAVAILABLE", "CANCELLED", "UNKNOWN"}
_SERVER_LOST = {"UNAVAILABLE", "CANCELLED", "UNKNOWN", "FAILED_PRECONDITION", "INVALID_ARGUMENT"}


def restart_wait() -> float:
    """How long a trainer waits for a dead server to come back (``LONGBOAT_PS_RESTART_WAIT``)."""
    return float(os.environ.get(RESTART_WAIT_ENV, DEFAULT_RESTART_WAIT_S))


@dataclass(frozen=True)
class Pushed:
    """One step's push as the servers received it."""

    step: int
    grads: list[torch.Tensor]
    lrs: list[float]
    rows: RowGrads  # sparse tables: name -> (ids, gradient rows)
    shrinks: list[list[str] | None] = field(default_factory=list)  # lb.ps.shrink after it


@dataclass(frozen=True)
class RecoveryContext:
    """What recovery works with (built by the engine, as a mode's `ModeContext` is)."""

    trainer: int
    client: Client
    dense: DenseParams
    sparse: SparseLookups
    param_groups: list[dict]  # the trainer's optimizer's: each push carries their rates
    step: Callable[[], int]  # the step being taken
    restart_at: Callable[[int], None]  # the engine goes on at this step
    restore: Callable[[int, float], object]  # roll every server back to a checkpoint step


class Recovery:
    """The replay log of one sync trainer and the procedure that uses it."""

    def __init__(self, ctx: RecoveryContext, window: int) -> None:
        self.ctx, self.window = ctx, window
        self.log: deque[Pushed] = deque(maxlen=window)
        self.boots = self._boots(ctx.client.timeout)
        self.active = False  # recovering now (no recovery inside recovery)

    def _boots(self, timeout: float) -> dict[int, str]:
        """Every server's process id (``boot``), to tell a restarted server from the old one."""
        client = self.ctx.client
        replies = client.call_all("ping", {s: Message() for s in range(len(client))}, timeout)
        return {s: str(r.meta["boot"]) for s, r in replies.items()}

    def record(self) -> None:
        """Log this step's gradients (dense and sparse) before they are pushed."""
        ctx = self.ctx
        grads = [g.detach().clone() for g in ctx.dense.grads()]
        lrs = [float(g["lr"]) for g in ctx.param_groups]
        self.log.append(Pushed(ctx.step(), grads, lrs, ctx.sparse.gradients()))

    def shrunk(self, tables: list[str] | None) -> None:
        """Log an ``lb.ps.shrink(tables)`` made by this trainer after the last logged step."""
        if self.log and self.log[-1].step == self.ctx.step() - 1:
            self.log[-1].shrinks.append(tables)

    def handles(self, exc: PSError) -> bool:
        return not self.active and exc.server >= 0 and exc.code in _SERVER_LOST

    def recover(self, exc: PSError, through: int) -> None:
        """Wait for the restarted server, roll back and replay the logged steps up to and
        including ``through``; the engine ends at step ``through + 1`` with its values pulled."""
        self.active = True
        try:
            self._recover(exc, through)
        finally:
            self.active = False

    def _recover(self, exc: PSError, through: int) -> None:
        ctx = self.ctx
        wait = restart_wait()
        log.warning(
            "trainer %d: parameter server %d (%s) failed (%s); waiting up to %.0fs for it to "
            "restart from its checkpoint",
            ctx.trainer,
            exc.server,
            exc.endpoint,
            exc.code,
            wait,
        )
        restored = self._wait_for_restart(exc, wait)
        oldest = self.log[0].step if self.log else ctx.step()
        if restored < oldest:
            raise PSError(
                f"parameter server restarted from step {restored}, but trainer "
                f"{ctx.trainer} kept its pushes only from step {oldest}; call "
                "model.engine.restore() and resume the loop from the step it returns",
                exc.server,
                exc.endpoint,
            ) from exc
        # lookups of the step after ``through`` (its forward) were pulled at the values the
        # replay recomputes: they stay recorded for that step's push
        current = ctx.sparse.clear() if through < ctx.step() else []
        ctx.restore(restored, wait)
        for pushed in [p for p in self.log if restored <= p.step <= through]:
            self._replay(pushed)
        ctx.restart_at(through + 1)
        ctx.dense.pull(through + 1)
        ctx.sparse.resume(current)
        log.warning(
            "trainer %d: parameter server %d is back; replayed steps %d..%d from its "
            "checkpoint, training goes on at step %d",
            ctx.trainer,
            exc.server,
            restored,
            through,
            through + 1,
        )

    def _wait_for_restart(self, exc: PSError, wait: float) -> int:
        """The checkpoint step of the restarted server(s), once every server answers."""
        client = self.ctx.client
        deadline = time.monotonic() + wait
        while True:
            try:
                replies = client.call_all("ping", {s: Message() for s in range(len(client))}, 2.0)
            except PSError:
                replies = None
            if replies is not None:
                boots = {s: str(r.meta["boot"]) for s, r in replies.items()}
                new = [s for s in boots if boots[s] != self.boots.get(s)]
                if not new and exc.code not in _SERVER_GONE:
                    raise exc  # every server is the same process: a refusal, not a restart
                if new:
                    steps = [replies[s].meta.get("restored") for s in new]
                    if any(v is None for v in steps):
                        raise PSError(
                            f"parameter server {new[0]} ({client.endpoints[new[0]]}) restarted "
                            "without a checkpoint: nothing to resume from (start the servers "
                            "with LONGBOAT_PS_CHECKPOINT_DIR and LONGBOAT_PS_CHECKPOINT_EVERY)",
                            new[0],
                            client.endpoints[new[0]],
                        ) from exc
                    self.boots = boots
                    return min(int(v) for v in steps)
            if time.monotonic() > deadline:
                raise PSError(
                    f"parameter server {exc.server} ({exc.endpoint}) did not come back within "
                    f"{wait:.0f}s ({RESTART_WAIT_ENV}); check its log and the launcher's "
                    "--max-restarts",
                    exc.server,
                    exc.endpoint,
                ) from exc
            time.sleep(0.5)

    def _replay(self, pushed: Pushed) -> None:
        """Push ``pushed`` again and wait until every server has applied its step (the next
        step's push of a sparse table waits on the server for this one to complete)."""
        ctx = self.ctx
        dense, groups = ctx.dense, ctx.param_groups
        current = [g["lr"] for g in groups]
        for g, lr in zip(groups, pushed.lrs, strict=True):
            g["lr"] = lr
        try:
            calls = dense.push(range(len(dense)), pushed.grads, pushed.step)
            calls += ctx.sparse.send(pushed.rows, pushed.step, every_server=True)
            wait_all(calls)
        finally:
            for g, lr in zip(groups, current, strict=True):
                g["lr"] = lr
        dense.collect(dense.start_pulls(pushed.step + 1))
        if pushed.shrinks:  # after the step, before this trainer's push of the next one
            ctx.sparse.wait(pushed.step + 1)
            for tables in pushed.shrinks:
                table_admin.shrink_on(ctx.client, tables)
