"""What an elastic job at sharding stage 3 shards again after a membership change: the user's
module on the meta device (structure, no data), taken by ``lb.distribute`` before FSDP2 is
applied (a module ``fully_shard`` was applied to cannot be copied), with its units and plan.
`longboat.sharding.elastic` reads it."""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from longboat.collective.plan import CollectivePlan
from longboat.sharding.model import FullyShardedModel
from longboat.sharding.units import Unit


@dataclass(frozen=True)
class Blueprint:
    """What `rebuild` shards again: the user's module on the meta device, the units by module
    name, and the plan of ``lb.distribute``."""

    module: nn.Module
    units: list[list[str]]
    plan: CollectivePlan


BLUEPRINTS: weakref.WeakKeyDictionary[FullyShardedModel, Blueprint] = weakref.WeakKeyDictionary()


def meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose parameters and buffers are on the meta device (no data
    copied; tied parameters stay tied)."""
    memo: dict[int, object] = {}
    for t in [*module.parameters(), *module.buffers()]:
        blank = torch.empty_like(t, device="meta")
        if isinstance(t, nn.Parameter):
            blank = nn.Parameter(blank, requires_grad=t.requires_grad)
        memo[id(t)] = blank
    return copy.deepcopy(module, memo)


def remember(
    model: FullyShardedModel, blank: nn.Module, units: list[Unit], plan: CollectivePlan
) -> None:
    """Keep what `rebuild` needs: ``blank`` (`meta_copy` of the module before recompute and
    ``fully_shard``), ``units`` as ``lb.distribute`` found them in the module."""
    names = {id(m): n for n, m in model.module.named_modules()}
    BLUEPRINTS[model] = Blueprint(blank, [[names[id(m)] for m in unit] for unit in units], plan)
