"""``async`` (``a_sync=True``, ``k_steps`` 0 or -1): a background communicator merges and
pushes gradients and pulls the current parameters; servers apply each push on arrival."""

from __future__ import annotations

import threading

import torch

from longboat.ps.trainer.communicator import AsyncCommunicator
from longboat.ps.trainer.modes import Exchange, Mode, ModeContext, StepCost, register
from longboat.ps.trainer.params import wait_all


@register("async")
class AsyncStep(Mode):
    """Queue the gradients; load the latest values the communicator pulled, if any."""

    pull_after_send = True  # the communicator pulls after each push (half_async: the step)

    @staticmethod
    def cost(x: Exchange) -> StepCost:
        """Trainers wait for no one: a step is the longer of a trainer's own compute, push and
        pull and the servers' time per step for every trainer's traffic."""
        return unsynchronised(x, 0.0, "async")

    def __init__(self, ctx: ModeContext) -> None:
        super().__init__(ctx)
        self._lock = threading.Lock()
        self._latest: dict[str, torch.Tensor] | None = None
        self._comm = AsyncCommunicator(
            self._send,
            max_merge=ctx.cfg.max_merge,
            queue_size=ctx.cfg.queue_size,
            wait_times=ctx.cfg.wait_times,
            timeout=ctx.params.client.timeout,
        )

    def _send(self, grads: list[torch.Tensor]) -> None:
        params = self.ctx.params
        wait_all(params.push(range(len(params)), grads, -1))
        if self.pull_after_send:
            values = params.collect(params.start_pulls(0))
            with self._lock:
                self._latest = values

    def _queue(self) -> None:
        with self.ctx.waiting("send queue"):
            self._comm.put(self.ctx.params.grads())
        with self.ctx.waiting("push"):
            wait_all(self.ctx.sparse.push(-1, every_server=False))

    def step(self) -> None:
        self._queue()
        with self._lock:
            latest, self._latest = self._latest, None
        if latest is not None:
            self.ctx.params.copy_in(latest)

    def flush(self) -> None:
        self._comm.flush()

    def close(self) -> None:
        self._comm.close()


def unsynchronised(x: Exchange, barrier: float, label: str) -> StepCost:
    """An async step, plus ``barrier`` seconds of waiting for the other trainers."""
    server_time = 2 * x.servers + x.update
    own = x.compute + 2 * (x.own + 2 * x.latency)
    step = max(own, server_time) + barrier
    return StepCost(step, step - x.compute, 0.0, 2 * (x.transfer + 2 * x.latency), label)
