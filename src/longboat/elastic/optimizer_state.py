"""What `State` keeps, hands around and compares of an optimizer: its whole ``state_dict``, or,
for a sharded optimizer (``Strategy(sharding=True)``), this rank's slices only, which
``State.sync`` reshards over the new world (`longboat.elastic.reshard`); at stage 3 this rank's
shards of the parameters too (`longboat.sharding.elastic_shards`); with float16 AMP, the loss
scaler's state (`loss_scaler`)."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from longboat.elastic.reshard import reshard as reshard_step
from longboat.optim.staged import StagedOptimizer, StageKind
from longboat.sharding.zero.slices import fill, local_slices, segments, shard_of, stateful
from longboat.sharding.zero.step import step_of

if TYPE_CHECKING:
    from longboat.collective.amp import LossScaler
    from longboat.sharding.optimizer import FullyShardedStep


def fully_sharded(optimizer: object) -> FullyShardedStep | None:
    """The stage 3 step of ``optimizer`` (None: another one; none exists before
    `longboat.sharding.optimizer` is imported, so its import is left to stage 3)."""
    module = sys.modules.get("longboat.sharding.optimizer")
    return module.stage3_step(optimizer) if module is not None else None


def loss_scaler(optimizer: object) -> LossScaler | None:
    """The float16 AMP loss scaler whose state ``State`` keeps with the optimizer's (scale
    and counters; every stage), or None."""
    if not isinstance(optimizer, StagedOptimizer):
        return None
    stage = optimizer.stage(StageKind.LOSS_SCALING)
    return getattr(stage, "scaler", None)


def _shards() -> Any:
    import longboat.sharding.elastic_shards as shards

    return shards


def is_sharded(optimizer: torch.optim.Optimizer | None) -> bool:
    return step_of(optimizer) is not None or fully_sharded(optimizer) is not None


def snapshot(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The state to snapshot at a commit (no communication)."""
    full = fully_sharded(optimizer)
    if full is not None:
        return _shards().local_shards(full)
    step = step_of(optimizer)
    return optimizer.state_dict() if step is None else local_slices(step)


def restore(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Load a `snapshot`. A sharded optimizer rebuilt for another world since keeps its state
    until ``State.sync`` reshards the snapshot."""
    full = fully_sharded(optimizer)
    if full is not None:
        _shards().restore(full, saved)
        return
    step = step_of(optimizer)
    if step is None:
        optimizer.load_state_dict(saved)
        return
    if not dist.is_initialized():
        return
    here = [list(seg) for seg in segments(step)]
    same = saved["shard"] == shard_of(step) and saved["pieces"] == here
    if not same or step.optimizer is None:
        return
    segs, states = stateful(saved)
    step.optimizer.state.clear()
    groups = {int(g): info for g, info in saved["groups"].items()}
    fill(step, groups, {0: segs}, lambda _, j: states[j])


def payload(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What the rank ``State.sync`` takes the state from sends of the optimizer: sharded, only
    the param groups (the slices are resharded)."""
    step = step_of(optimizer) or fully_sharded(optimizer)
    if step is None:
        return optimizer.state_dict()
    return {"param_groups": step.user.state_dict()["param_groups"]}


def load_payload(optimizer: torch.optim.Optimizer, sent: dict[str, Any]) -> None:
    from longboat.sharding.zero.state import load_param_groups

    step = step_of(optimizer) or fully_sharded(optimizer)
    if step is None:
        optimizer.load_state_dict(sent)
    else:
        load_param_groups(step, sent["param_groups"])  # type: ignore[arg-type]  # its user's


def digested(optimizer: torch.optim.Optimizer) -> Any:
    """What every rank must hold alike: the ``state_dict``, or, sharded, the param groups (the
    slices differ between ranks by design; resharding checks that every element is held)."""
    return payload(optimizer)


def reshard(
    optimizer: torch.optim.Optimizer | None, held: Mapping[str, Any] | None, commits: int
) -> bool:
    """Collective: a sharded optimizer's state from the slices the ranks ``held`` at
    ``commits`` (None: this rank holds none); True if the optimizer is sharded (at stage 3:
    the parameters' shards too)."""
    full = fully_sharded(optimizer)
    if full is not None:
        _shards().reshard(full, held, commits)
        return True
    step = step_of(optimizer)
    if step is None:
        return False
    reshard_step(step, held, commits)
    return True
