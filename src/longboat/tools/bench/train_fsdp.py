"""`longboat bench train` at sharding stage 3: torch's FSDP2 applied by hand, the yardstick
longboat's stage 3 must not fall behind, and what an FSDP2 system holds per rank.

The hand-applied system calls ``fully_shard`` itself, as an FSDP2 user's script does, on the
units longboat chooses for the same Strategy (`longboat.sharding.fsdp.plan_units`) and then on
the root, over torch's own device mesh (1-D over the ranks; with ``sharding_degree`` below the
world size, the 2-D HSDP mesh) with the mixed-precision policy AMP maps to; the optimizer is
built after it, over the sharded parameters. So the two differ only in what longboat adds
around FSDP2 (its model wrapper, the staged optimizer).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

#: with sharding stage 3: torch's fully_shard applied by hand to longboat's units and the root
FSDP_BY_HAND = "fsdp2 by hand"


def stage3(strategy: dict[str, Any]) -> bool:
    """Whether longboat's side runs at sharding stage 3 (FSDP2)."""
    configs = dict(strategy.get("sharding_configs") or {})
    return bool(strategy.get("sharding")) and int(configs.get("stage", 1)) == 3


def fully_shard_by_hand(model: nn.Module, strategy: dict[str, Any], device: torch.device) -> None:
    """``fully_shard`` on the units longboat chooses for ``strategy``, then on the root, with
    rank 0's parameters first (as ``lb.distribute`` starts from them). Collective."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import longboat as lb
    from longboat.collective.live import live_placement
    from longboat.collective.plan import resolve
    from longboat.sharding.fsdp import plan_units
    from longboat.sharding.policies import FullyShardPolicy

    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, 0)
    plan = resolve(lb.Strategy(**strategy), live_placement())
    world = dist.get_world_size()
    degree = FullyShardPolicy.of(plan, world, lb.local_world_size(), lb.num_nodes()).degree
    if degree == world:
        mesh = init_device_mesh(device.type, (world,))
    else:
        mesh = init_device_mesh(device.type, (world // degree, degree))
    reduce = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(plan.compression.name)
    compute = torch.bfloat16 if plan.amp is not None else None  # stage 3 refuses float16 AMP
    if compute is not None and reduce is None:
        reduce = torch.float32
    options: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce),
    }
    for unit in plan_units(model, plan):
        fully_shard(unit if len(unit) > 1 else unit[0], **options)
    fully_shard(model, **options)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a DTensor's shard, else the tensor."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def fully_sharded_held(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """(optimizer state, gradients, parameters) of an FSDP2 model, by local shard: longboat's
    stage 3 (its rebuilt optimizer steps the shards) or FSDP2 by hand."""
    from longboat.optim.staged import StagedOptimizer, StageKind
    from longboat.sharding.model import FullyShardedModel

    if isinstance(model, FullyShardedModel):
        model = model.module
    if isinstance(optimizer, StagedOptimizer):
        step = optimizer.stage(StageKind.SHARDED_STEP)
        optimizer = getattr(step, "optimizer", optimizer)
    state = [local(t) for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    params = [local(p) for p in model.parameters()]
    grads = [local(p.grad) for p in model.parameters() if p.grad is not None]
    return state, grads, params


def is_fully_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    from longboat.sharding.model import FullyShardedModel

    return isinstance(model, (FullyShardedModel, FSDPModule))
