"""Sharding stage 3 in an elastic job: the model rebuilt for a new world.

FSDP2 binds each sharded parameter to the device mesh of the world ``lb.distribute`` ran in,
and a module ``fully_shard`` was applied to cannot be copied or sharded again. So
``lb.distribute`` keeps a copy of your module on the meta device (its structure and no data)
taken before it is sharded. After a membership change `rebuild` shards
a fresh copy of it over the new world (the same units and policies), allocates this rank's
shards, makes it ``model.module`` and rebuilds the optimizer over its parameters; then
``State.sync`` fills the shards from what the ranks held at their last commit
(`longboat.sharding.elastic_shards`).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

import longboat.cluster as cluster
from longboat.optim.staged import StagedOptimizer
from longboat.recompute import apply_recompute
from longboat.sharding.blueprint import BLUEPRINTS, Blueprint, meta_copy
from longboat.sharding.model import FullyShardedModel
from longboat.sharding.optimizer import FullyShardedStep, stage3_step
from longboat.sharding.optimizer import rebuild as rebuild_optimizer
from longboat.sharding.policies import FullyShardPolicy


def rebuild(model: FullyShardedModel, optimizer: torch.optim.Optimizer | None) -> None:
    """Shard ``model`` over the current world anew (collective: the same calls, in the same
    order, as ``lb.distribute`` on a rank that joins now). Its parameters and the optimizer's
    state are left unset: ``State.sync`` fills them."""
    from longboat.collective.live import live_placement
    from longboat.sharding.fsdp import join, shard

    blueprint = BLUEPRINTS.get(model)
    step = stage3_step(optimizer)
    if blueprint is None or step is None:
        raise ValueError(
            "sharding stage 3 moves to a new world only the model and optimizer "
            "lb.distribute returned: give both to lb.elastic.State"
        )
    plan = blueprint.plan.on(live_placement())
    old = model.module
    where = next(old.parameters())
    device = (where.to_local() if isinstance(where, DTensor) else where).device
    fresh = meta_copy(blueprint.module)
    join(fresh, plan, scratch=device)
    policy = FullyShardPolicy.of(
        plan, cluster.world_size(), cluster.local_world_size(), cluster.num_nodes()
    )
    apply_recompute(fresh, plan.recompute)
    units = [[fresh.get_submodule(name) for name in unit] for unit in blueprint.units]
    shard(fresh, units, policy, device.type)
    fresh.to_empty(device=device)
    for name, buffer in old.named_buffers():  # this rank's own, until State.sync says else
        owner, _, leaf = name.rpartition(".")
        setattr(fresh.get_submodule(owner), leaf, buffer)  # a registered buffer stays one
    new = dict(fresh.named_parameters())
    replaced = {id(p): new[name] for name, p in old.named_parameters()}
    sharded = rebuild_optimizer(step.user, replaced)
    model.take(fresh, policy)
    assert isinstance(optimizer, StagedOptimizer)
    new_step = FullyShardedStep(step.user, sharded, fresh, policy.degree, step.divide_by)
    optimizer.set_stage(new_step)
    if model.scaling is not None:  # float16 AMP unscales the new optimizer's gradients
        model.scaling.sharded = new_step
        model.scaling.zero_grad(lambda set_to_none: None, True)  # a step begun is dropped
    BLUEPRINTS[model] = Blueprint(blueprint.module, blueprint.units, plan)
