"""``half_async`` (async plus ``use_thread_barrier=True``): the async pushes, then every step
flushes the queue, waits at a barrier of all trainers and pulls."""

from __future__ import annotations

from longboat.ps.trainer.modes import Exchange, StepCost, register
from longboat.ps.trainer.modes.a_sync import AsyncStep, unsynchronised


@register("half_async")
class HalfAsyncStep(AsyncStep):
    """Queue the gradients, send them all, meet the other trainers, pull."""

    pull_after_send = False

    @staticmethod
    def cost(x: Exchange) -> StepCost:
        """As async, plus the barrier's round trip to the servers each step."""
        return unsynchronised(x, 2 * x.latency, "half_async")

    def step(self) -> None:
        self._queue()
        with self.ctx.waiting("push"):
            self._comm.flush()
        self.ctx.params.barrier()
        self.ctx.params.pull(0)
