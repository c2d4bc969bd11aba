"""``geo`` (``a_sync=True``, ``k_steps > 0``): trainers run their own optimizer; every k steps
they push (parameter - value at last sync) / trainers and pull the global values."""

from __future__ import annotations

import torch

from longboat.ps.trainer.modes import Exchange, Mode, ModeContext, StepCost, register
from longboat.ps.trainer.params import wait_all


@register("geo")
class GeoStep(Mode):
    """A local step; every ``k_steps`` push the deltas since the last sync and pull."""

    update = "delta"
    uses_k_steps = True

    @staticmethod
    def cost(x: Exchange) -> StepCost:
        """A local optimizer step each step; push, pull and the servers' update every k."""
        comm = 2 * (x.transfer + 2 * x.latency)
        every = (comm + x.update) / x.k_steps
        return StepCost(
            x.compute + x.optimizer + every, every, x.optimizer, comm, f"geo k={x.k_steps}"
        )

    def __init__(self, ctx: ModeContext) -> None:
        super().__init__(ctx)
        self._base = self._snapshot()

    def _snapshot(self) -> list[torch.Tensor]:
        return [p.detach().clone() for _, p in self.ctx.params.params]

    def step(self) -> None:
        ctx, params = self.ctx, self.ctx.params
        ctx.local_step()
        with ctx.waiting("push"):
            wait_all(ctx.sparse.push(-1, every_server=False))
        if (ctx.step() + 1) % ctx.cfg.k_steps:
            return
        deltas = [
            (p.detach() - base) / ctx.trainers
            for (_, p), base in zip(params.params, self._base, strict=True)
        ]
        with ctx.waiting("push"):
            wait_all(params.push(range(len(params)), deltas, -1))
        params.pull(0)
        self._base = self._snapshot()
