"""``sync`` (``a_sync=False``): servers average every trainer's gradient per block and apply one
update per step; trainers pull the result (overlapped with the next forward by default)."""

from __future__ import annotations

import torch

from longboat.ps.trainer.communicator import HookPusher
from longboat.ps.trainer.modes import Exchange, Mode, ModeContext, StepCost, register
from longboat.ps.trainer.params import part, wait_all


@register("sync")
class SyncStep(Mode):
    """Push (bucketed during backward with ``overlap``), then pull step + 1's values: the last
    push to each server asks for them, so a step costs one call per server and bucket."""

    sync = True
    trainer_optimizer = True
    recoverable = True

    @staticmethod
    def cost(x: Exchange) -> StepCost:
        """After backward: push and pull in one call per server, then the servers' update."""
        exchange = 2 * x.transfer + 2 * x.latency
        return StepCost(x.compute + exchange + x.update, exchange, x.update, exchange, "sync")

    def __init__(self, ctx: ModeContext) -> None:
        super().__init__(ctx)
        self._pusher: HookPusher | None = None
        if ctx.cfg.overlap:
            params = ctx.params
            self._pusher = HookPusher(
                [p for _, p in params.params],
                lambda indices, last: params.push_grads(
                    indices, ctx.step(), ctx.step() + 1 if last else None
                ),
                ctx.cfg.bucket_bytes,
                tune=ctx.cfg.tune_buckets,
            )

    def step(self) -> None:
        ctx, params, step = self.ctx, self.ctx.params, self.ctx.step()
        with ctx.waiting("push"):
            if self._pusher is not None:
                calls = [c for started in self._pusher.finish() for c in started.result()]
            else:
                calls = params.push_grads(range(len(params)), step, step + 1)
            pushes, pulling = params.pulls_in(calls)
            wait_all(pushes)
            wait_all(ctx.sparse.push(step, every_server=True))
        if ctx.cfg.update_on_server:
            params.pending = params.start_pulls(step + 1, have=pulling)
            if not ctx.cfg.overlap:
                params.synchronize()
            return
        with ctx.waiting("pull"):
            means = params.collect(params.start_pulls(step + 1, have=pulling))
        for (_, p), blocks in zip(params.params, params.blocks, strict=True):
            grad = torch.empty_like(p)
            for b in blocks:
                part(grad, b).copy_(means[b.key])
            p.grad = grad
        ctx.local_step()

    def abandon(self) -> None:
        if self._pusher is not None:
            self._pusher.abandon()

    def close(self) -> None:
        if self._pusher is not None:
            self._pusher.close()
