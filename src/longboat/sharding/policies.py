"""The Strategy mapped onto FSDP2's settings: the device mesh (HSDP below the world size), the
mixed-precision policy (AMP, the reduce dtype) and the offload policy."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from longboat.words import plural

if TYPE_CHECKING:
    from longboat.collective.plan import CollectivePlan
    from longboat.sharding.config import ShardingPlan

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
REDUCE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
"""``gradient_compression`` (``fp16_allreduce`` selects ``fp16``) -> FSDP2's reduce dtype."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FullyShardPolicy:
    """What ``fully_shard`` is called with, for every unit and the root."""

    degree: int
    """Ranks each parameter is split over."""
    replicas: int
    """Shard groups (HSDP: each holds a whole copy, split ``degree`` ways)."""
    param_dtype: torch.dtype | None
    """AMP's compute dtype (the shards stay float32), or None."""
    reduce_dtype: torch.dtype | None
    """The dtype gradients are reduce-scattered in, or None (the parameters')."""
    offload: bool
    """``sharding_configs['offload']``: shards, gradients and optimizer state in CPU memory."""

    @classmethod
    def of(
        cls, plan: CollectivePlan, world: int, ranks_per_node: int, nodes: int
    ) -> FullyShardPolicy:
        """The policy of ``plan`` in a job of ``world`` ranks. ``sharding_degree`` 0 shards
        within a node when the job spans several (HSDP across nodes), else over every rank."""
        assert plan.sharding is not None
        degree = stage3_degree(plan.sharding, world, ranks_per_node, nodes)
        param_dtype = None
        if plan.amp is not None:
            param_dtype = _DTYPES[str(plan.amp["dtype"])]
        reduce_dtype = REDUCE_DTYPES.get(plan.compression.name)
        if param_dtype is not None and reduce_dtype is None:
            reduce_dtype = torch.float32  # AMP alone: reduce in the master weights' dtype
        return cls(
            degree=degree,
            replicas=world // degree,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            offload=plan.sharding.offload,
        )

    def mesh(self, device_type: str) -> DeviceMesh:
        """The device mesh (collective): 1-D over the shard group, or 2-D (replicate, shard)."""
        if self.replicas == 1:
            return init_device_mesh(device_type, (self.degree,), mesh_dim_names=("shard",))
        return init_device_mesh(
            device_type, (self.replicas, self.degree), mesh_dim_names=("replicate", "shard")
        )

    def mixed_precision(self) -> MixedPrecisionPolicy:
        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)

    def offload_policy(self, device_type: str) -> OffloadPolicy:
        if not self.offload:
            return OffloadPolicy()
        return CPUOffloadPolicy(pin_memory=device_type == "cuda")

    def describe(self) -> str:
        """One line for the log and the launcher banner."""
        parts = [f"sharding stage 3 (FSDP2) over {self.degree} rank(s)"]
        if self.replicas > 1:
            parts.append(f"{self.replicas} replicas (HSDP)")
        if self.param_dtype is not None:
            parts.append(f"compute in {_name(self.param_dtype)}")
        if self.reduce_dtype is not None:
            parts.append(f"reduce in {_name(self.reduce_dtype)}")
        if self.offload:
            parts.append("shards offloaded to CPU")
        return ", ".join(parts)


def stage3_degree(sharding: ShardingPlan, world: int, ranks_per_node: int, nodes: int) -> int:
    """Ranks each parameter is split over: ``sharding_degree``, or for 0 the ranks of a node
    when the job spans several nodes of equal size (HSDP across nodes), else every rank.
    ValueError naming the field when it does not divide the world."""
    if sharding.degree == 0 and nodes > 1 and ranks_per_node * nodes == world:
        sharding = replace(sharding, degree=ranks_per_node)
    return sharding.degree_in(world, dist.get_rank() if dist.is_initialized() else 0)


def banner(sharding: ShardingPlan | None, world: int, ranks_per_node: int, nodes: int) -> str:
    """``, sharding stage S over D ranks`` for the launcher's cluster line ('' without
    sharding, or when the degree does not fit the world: lb.distribute says why)."""
    if sharding is None:
        return ""
    try:
        if sharding.stage == 3:
            degree = stage3_degree(sharding, world, ranks_per_node, nodes)
        else:
            degree = sharding.degree_in(world, 0)
    except ValueError:
        return ""
    replicas = f" x {plural(world // degree, 'replica')}" if degree < world else ""
    return f", sharding stage {sharding.stage} over {plural(degree, 'rank')}{replicas}"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
