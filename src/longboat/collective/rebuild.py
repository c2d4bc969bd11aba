"""Give a DistributedModel the communicators and reducer of a new world (elastic training)."""

from __future__ import annotations

import torch

from longboat.collective.engine import build_reducer, join_world, shard_setup
from longboat.collective.live import live_placement
from longboat.collective.model import DistributedModel
from longboat.optim.staged import StagedOptimizer
from longboat.registry import COMPRESSORS
from longboat.sharding.zero.step import ShardedStep, step_of
from longboat.trace import attach


class RebuildError(ValueError):
    """The model's Strategy keeps state that cannot move to a new world yet."""


def check_rebuildable(model: DistributedModel) -> None:
    """Refuse, up front, Strategy settings whose state is bound to one world."""
    plan = model.plan
    if plan is None:  # not built by lb.distribute
        return
    if model.tuner is not None:
        raise RebuildError(
            "Strategy(auto=True) times reducers for one world; elastic training needs fixed "
            "settings: set auto=False and the fields the tuner chose (longboat bench comm)"
        )
    entry = COMPRESSORS.entry(plan.compression.name)
    if not entry.elastic:
        off = f"{entry.switch}=False" if entry.switch else "another gradient_compression"
        raise RebuildError(
            f"{entry.label} keeps {entry.state or 'state'} per rank, which a new world cannot "
            f"take over; elastic training supports the other compressors: set {off}"
        )


def rebuild(model: DistributedModel, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Replace ``model``'s reducer and communicators with ones for the current process group.

    Collective (every rank, in the same order), after ``lb.shutdown``/``lb.init`` formed the
    new world: the same collectives as ``lb.distribute`` (a rank joining late runs that), so
    rank 0's parameters are broadcast (``State.sync`` then installs the committed state).
    Parameters, the optimizer's stages and the module are kept; the old reducer's gradient
    hooks are removed; timeline and stall inspector are attached anew (``optimizer``, the one
    ``lb.distribute`` returned, records its steps into the new timeline). Under sharding the
    sharded step is built anew for the new world's shard groups, without state:
    ``State.sync`` reshards the state the ranks held (`longboat.elastic.reshard`).
    """
    check_rebuildable(model)
    if model.plan is None:
        raise RebuildError("only a model lb.distribute returned can move to a new world")
    sharded = step_of(optimizer)
    if model.plan.sharding is not None and sharded is None:
        raise RebuildError(
            "sharding: pass the optimizer lb.distribute returned to the rebuild (as "
            "lb.elastic.State(optimizer=...) does): its shards are laid out anew"
        )
    model.drop_pending_writes()  # the broadcast below writes into every parameter
    old = model.reducer
    plan = model.plan.on(live_placement())  # the new world's placement decides anew
    comm = join_world(model.module, plan)  # meets newcomers in lb.distribute's calls
    named = list(zip(old.names, old.params, strict=True))
    sharding = shard_setup(named, plan, sharded.user if sharded is not None else None, comm.fns)
    reducer, compressors = build_reducer(  # shards made after join_world, as lb.distribute does
        named,
        plan,
        optimizer,
        communicators=comm.pair,
        check_finite=old.check_finite,
        sharding=sharding,
    )
    model.replace_reducer(reducer, compressors, plan, keep_observer=False)
    model.micro_step = 0
    if sharded is not None and sharding is not None:
        assert isinstance(optimizer, StagedOptimizer)
        optimizer.set_stage(ShardedStep(sharded.user, model, sharding))
    attach(model, optimizer, plan.trace)  # the optimizer's timeline stage records anew
