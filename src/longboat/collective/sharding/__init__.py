"""Sharding (ZeRO stage 1 and 2) inside data parallelism: ``Strategy(sharding=True)``.

``config`` (the resolved settings), ``layout`` (which slice of each gradient bucket a rank
owns), ``groups`` (the shard and replica process groups), ``reducer`` (stage 2's
reduce-scattering reducer), ``step`` (the optimizer stage that steps the shards and gathers
the parameters), ``state`` (``state_dict`` in torch's unsharded layout), ``clip`` (the global
gradient norm over shards) and ``memory`` (bytes per rank). See docs/sharding.md.
"""

from longboat.collective.sharding.config import ShardingPlan

__all__ = ["ShardingPlan"]
