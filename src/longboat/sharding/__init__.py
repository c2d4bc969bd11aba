"""Sharding stage 3: parameters, gradients and optimizer state split across ranks, on torch's
FSDP2 (``torch.distributed.fsdp.fully_shard``), behind
``Strategy(sharding=True, sharding_configs={"stage": 3})``.

``policies`` (the Strategy mapped onto FSDP2's mesh, mixed precision and offload policies),
``units`` (which modules become FSDP units), ``fsdp`` (``lb.distribute`` at stage 3),
``model`` (the returned module wrapper), ``optimizer`` (the user's optimizer rebuilt over the
sharded parameters, stepped as a `StagedOptimizer` stage), ``state`` (the plain full layout of
``state_dict``), ``checkpoint`` (per-rank files with torch's distributed checkpoint). Stages 1
and 2 ride on the reducer: ``longboat.collective.sharding``. See docs/sharding.md.
"""

from longboat.sharding.model import FullyShardedModel

__all__ = ["FullyShardedModel"]
