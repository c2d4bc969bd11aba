"""A parameter-server mode in one file, registered from outside src/: selectable from the
Strategy (``a_sync_configs={"mode": "toy_eager"}``) and priced by ``longboat sim``."""

from __future__ import annotations

from longboat.ps.trainer.modes import Exchange, Mode, StepCost, register, wait_all

NAME = "toy_eager"


@register(NAME)
class ToyEager(Mode):
    """Push, wait for every server, pull: a sync step without overlap."""

    sync = True

    @staticmethod
    def cost(x: Exchange) -> StepCost:
        """Push and pull are two calls per server, each waited for after backward."""
        exchange = 2 * (x.transfer + 2 * x.latency)
        return StepCost(x.compute + exchange + x.update, exchange, x.update, exchange, NAME)

    def step(self) -> None:
        params, step = self.ctx.params, self.ctx.step()
        wait_all(params.push_grads(range(len(params)), step))
        wait_all(self.ctx.sparse.push(step, every_server=True))
        params.pull(step + 1)
