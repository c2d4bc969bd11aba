"""``lb.distribute`` at sharding stage 3: check the ranks agree, broadcast rank 0's state, apply
``fully_shard`` to the units and the root, rebuild the optimizer over the sharded parameters."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import longboat.cluster as cluster
from longboat.collective.amp import Amp
from longboat.collective.consistency import (
    broadcast_state,
    verify_same_model,
    verify_same_settings,
)
from longboat.collective.plan import CollectivePlan
from longboat.log import get_logger
from longboat.optim.staged import Stage, StagedOptimizer
from longboat.recompute import apply_recompute
from longboat.sharding.amp import ShardedLossScaling
from longboat.sharding.blueprint import meta_copy, remember
from longboat.sharding.model import FullyShardedModel
from longboat.sharding.optimizer import FullyShardedStep, rebuild
from longboat.sharding.policies import FullyShardPolicy
from longboat.sharding.units import Unit, describe, named_units, planned_units
from longboat.trace.stall import waiting, watch_collectives

log = get_logger("longboat.sharding")


def distribute_fully_sharded(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, plan: CollectivePlan
) -> tuple[FullyShardedModel, torch.optim.Optimizer]:
    """The stage 3 model and optimizer of ``plan`` (collective: every rank, in order)."""
    assert plan.sharding is not None
    if isinstance(model, FullyShardedModel):
        raise ValueError("this model was already passed to lb.distribute")
    if optimizer is None:
        raise ValueError("sharding splits the optimizer's state: pass the optimizer")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no parameters that require grad: nothing to train")
    device_type = params[0].device.type
    watch_collectives(plan.trace)
    join(model, plan)
    policy = FullyShardPolicy.of(
        plan, dist.get_world_size(), cluster.local_world_size(), cluster.num_nodes()
    )
    blank = meta_copy(model)  # what an elastic job's next world shards again
    apply_recompute(model, plan.recompute)  # inside a unit: its forward recomputed in backward
    units = plan_units(model, plan)
    names = {id(p): n for n, p in model.named_parameters()}
    shard(model, units, policy, device_type)
    replaced = {pid: model.get_parameter(name) for pid, name in names.items()}
    sharded = rebuild(optimizer, replaced)
    k_steps = plan.merge.k_steps if plan.merge is not None else 1
    avg = plan.merge is not None and plan.merge.avg
    step = FullyShardedStep(optimizer, sharded, model, policy.degree, k_steps if avg else 1)
    amp = Amp(plan.amp, device_type) if plan.amp is not None else None  # FSDP2 casts, not autocast
    scaling = (
        ShardedLossScaling(amp.scaler, step, device_type)
        if amp is not None and amp.scaler is not None
        else None
    )
    wrapped = FullyShardedModel(
        model,
        policy,
        k_steps=k_steps,
        merge_avg=avg,
        broadcast_buffers=plan.broadcast_buffers,
        amp=amp,
        scaling=scaling,
    )
    stages: list[Stage] = [step]
    if scaling is not None:
        stages.append(scaling)
    if k_steps > 1:
        from longboat.collective.optimizer import MergeGate

        stages.append(MergeGate(wrapped))  # type: ignore[arg-type]  # is_merge_boundary
    remember(wrapped, blank, units, plan)
    if cluster.rank() == 0:
        log.info("%s; %s", policy.describe(), describe(model, units))
    return wrapped, StagedOptimizer(optimizer, stages)


def join(model: nn.Module, plan: CollectivePlan, scratch: torch.device | None = None) -> None:
    """The collectives ``lb.distribute`` starts with, in order: the ranks agree on the settings
    and the model, and take rank 0's parameters unless a rank carries state from an earlier
    round of an elastic job (``State.sync`` brings it). A rank sharding anew after a
    membership change (`longboat.sharding.elastic`) runs them too, meeting a rank that joins:
    ``model`` is on the meta device there, and a broadcast goes through ``scratch`` tensors."""
    from longboat.collective.live import state_carried_over

    with waiting("settings check of lb.distribute (Strategy fields)"):
        verify_same_settings(plan.shared_settings)
    with waiting("model check of lb.distribute (parameter names and shapes)"):
        verify_same_model(model)
    if state_carried_over():
        return
    tensors = [p for _, p in model.named_parameters()] + [b for _, b in model.named_buffers()]
    if scratch is not None:  # State.sync sets them after
        tensors = [torch.empty_like(t, device=scratch) for t in tensors]
    with waiting("broadcast of parameters"):
        broadcast_state(tensors, coalesce=plan.coalesce_broadcast)


def plan_units(model: nn.Module, plan: CollectivePlan) -> list[Unit]:
    """The units ``lb.distribute`` shards ``model`` into under ``plan`` (innermost first; the
    rest is the root's): ``sharding_configs['units']``, else the plan's grouping."""
    assert plan.sharding is not None
    if plan.sharding.units:
        return named_units(model, plan.sharding.units)
    return planned_units(model, plan.comm.bucket_mb, plan.comm.layers_per_bucket)


def shard(model: nn.Module, units: list[Unit], policy: FullyShardPolicy, device_type: str) -> None:
    """``fully_shard`` on every unit (innermost first), then on the root (collective)."""
    mesh = policy.mesh(device_type)
    options = {
        "mesh": mesh,
        "mp_policy": policy.mixed_precision(),
        "offload_policy": policy.offload_policy(device_type),
    }
    for unit in units:
        fully_shard(unit if len(unit) > 1 else unit[0], **options)  # type: ignore[arg-type]
    fully_shard(model, **options)  # type: ignore[arg-type]
