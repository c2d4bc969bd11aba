"""Give a DistributedModel the communicators and reducer of a new world (elastic training)."""

from __future__ import annotations

import torch

from longboat.collective.engine import build_reducer, join_world, live_placement
from longboat.collective.model import DistributedModel
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
    if plan.sharding is not None:
        raise RebuildError(
            "sharding lays the optimizer state out over this world's ranks; elastic training "
            "needs the full state on every rank: set sharding=False, or restart the job from "
            "a checkpoint (optimizer.state_dict() is gathered into the unsharded layout)"
        )
    if plan.compression.name == "dgc":
        raise RebuildError(
            "DGC keeps residuals and momentum per rank, which a new world cannot take over; "
            "elastic training supports the other compressors: set dgc=False"
        )


def rebuild(model: DistributedModel, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Replace ``model``'s reducer and communicators with ones for the current process group.

    Collective (every rank, in the same order), after ``lb.shutdown``/``lb.init`` formed the
    new world: the same collectives as ``lb.distribute`` (a rank joining late runs that), so
    rank 0's parameters are broadcast (``State.sync`` then installs the committed state).
    Parameters, the optimizer's stages and the module are kept; the old reducer's gradient
    hooks are removed; timeline and stall inspector are attached anew (``optimizer``, the one
    ``lb.distribute`` returned, records its steps into the new timeline).
    """
    check_rebuildable(model)
    if model.plan is None:
        raise RebuildError("only a model lb.distribute returned can move to a new world")
    old = model.reducer
    plan = model.plan.on(live_placement())  # the new world's placement decides anew
    comm = join_world(model.module, plan)  # meets newcomers in lb.distribute's calls
    reducer, compressors = build_reducer(
        list(zip(old.names, old.params, strict=True)),
        plan,
        optimizer,
        communicators=comm.pair,
        check_finite=old.check_finite,
    )
    model.replace_reducer(reducer, compressors, plan, keep_observer=False)
    model.micro_step = 0
    attach(model, optimizer, plan.trace)  # the optimizer's timeline stage records anew
