"""The sharded step (sharding stage 1 and 2): `ShardedStep` steps this rank's slices through a
`ShardOptimizer` in place of the user's optimizer, then all-gathers the updated parameters
(`longboat.sharding.zero.gather`): inside the step, or, with ``comm_overlap``, during the
next forward. `step_of` finds the shard optimizer of an optimizer ``lb.distribute`` returned.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from longboat.collective.model import DistributedModel
from longboat.optim.staged import Stage, StagedOptimizer, StageKind, StepRest
from longboat.sharding.zero.gather import ParameterGather
from longboat.sharding.zero.setup import ShardSetup
from longboat.sharding.zero.shard_optimizer import ShardOptimizer
from longboat.sharding.zero.state import gather_state_dict, load_gathered_state_dict


def step_of(optimizer: object) -> ShardOptimizer | None:
    """The shard optimizer of an optimizer ``lb.distribute`` returned, or None (not sharded)."""
    if not isinstance(optimizer, StagedOptimizer):
        return None
    stage = optimizer.stage(StageKind.SHARDED_STEP)
    return stage.shards if isinstance(stage, ShardedStep) else None


class ShardedStep(Stage):
    """Step an optimizer over this rank's shards, then all-gather the parameters."""

    kind = StageKind.SHARDED_STEP

    def __init__(
        self, optimizer: torch.optim.Optimizer, model: DistributedModel, setup: ShardSetup
    ) -> None:
        self.model = model
        self.overlap = setup.plan.overlap  # the all-gather during the next forward (eager only)
        reducer = model.reducer
        self.shards = ShardOptimizer(optimizer, reducer.params, reducer.names, setup)
        self.gather = ParameterGather(
            setup.layout.buckets, reducer.params, self.shards.flat, setup.groups
        )
        model.drop_pending_writes()  # a sharded step built anew (elastic) replaces the old one
        model.pending_writes = self.gather

    def step(self, rest: StepRest, closure: Any = None, **kwargs: Any) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            self.gather.finish()
            self.shards.step(**kwargs)
        if self.overlap and self.model.runs_eagerly():
            self.gather.watch(self.model.module)  # overlaps from the second step on
        else:
            self.gather.stop_overlap()
        self.gather.after_step()
        # an LR scheduler built on the user's optimizer checks that it stepped (torch sets
        # this flag from the step it wraps, which sharding replaces)
        self.shards.user._opt_called = True  # type: ignore[attr-defined]
        return loss

    def state_dict(self, rest: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        self.gather.finish()  # a checkpoint of both reads complete parameters next
        return gather_state_dict(self.shards)

    def load_state_dict(
        self, rest: Callable[[dict[str, Any]], None], state_dict: dict[str, Any]
    ) -> None:
        load_gathered_state_dict(self.shards, state_dict)

    def __repr__(self) -> str:
        return f"ShardedStep({self.shards!r})"
