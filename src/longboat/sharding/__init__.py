"""Sharding: the optimizer state, the gradients and (stage 3) the parameters split across the
ranks of a sharding group, behind ``Strategy(sharding=True, sharding_configs={"stage": S})``.

``config``: the resolved settings of every stage (`ShardingPlan`).

``zero``: stages 1 and 2, which ride on the collective engine's reducer (the gradient buckets'
slices, reduce-scatter, all-gather of the parameters); its own docstring lists its modules.

Stage 3, on torch's FSDP2 (``torch.distributed.fsdp.fully_shard``): ``policies`` (the Strategy
mapped onto FSDP2's mesh, mixed precision and offload policies), ``units`` (which modules
become FSDP units), ``fsdp`` (``lb.distribute`` at stage 3), ``model`` (the returned module
wrapper), ``optimizer`` (the user's optimizer rebuilt over the sharded parameters, stepped as a
`StagedOptimizer` stage), ``amp`` (float16 loss scaling over the shards), ``state`` (the plain
full layout of ``state_dict``), ``checkpoint`` (per-rank files with torch's distributed
checkpoint), ``elastic`` and ``elastic_shards`` (sharding anew after a membership change).

See docs/sharding.md.
"""

from typing import Any

__all__ = ["FullyShardedModel"]


def __getattr__(name: str) -> Any:
    if name == "FullyShardedModel":  # imported on use: `config` alone stays light
        from longboat.sharding.model import FullyShardedModel

        return FullyShardedModel
    raise AttributeError(f"module 'longboat.sharding' has no attribute {name!r}")
