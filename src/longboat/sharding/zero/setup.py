"""Sharding as ``lb.distribute`` sets it up, once per world: which optimizers it takes, the
shard groups, the bucket plan the slices are cut from, this rank's layout, and stage 2's bucket
collective. The reducer and the sharded step are both built from one `ShardSetup`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from longboat.collective.buckets import BucketPlan
from longboat.optim.layerwise import LayerwiseOptimizer
from longboat.sharding.config import ShardingPlan
from longboat.sharding.zero.groups import ShardGroups
from longboat.sharding.zero.layout import ShardLayout
from longboat.sharding.zero.scatter import SliceScatter

ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Adamax,
    torch.optim.ASGD,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
)
"""Optimizers whose update of an element reads only that element's state: a flat slice of
many parameters steps exactly as the parameters would. Layer-wise ones (LARS, LAMB) also
work: the norms of their slices are summed per parameter (`longboat.sharding.zero.norms`)."""


def check_elementwise(optimizer: torch.optim.Optimizer) -> None:
    """ValueError unless ``optimizer`` updates every element on its own (exact class) or is
    one of longboat's layer-wise optimizers."""
    if type(optimizer) not in ELEMENTWISE and not isinstance(optimizer, LayerwiseOptimizer):
        names = ", ".join(c.__name__ for c in ELEMENTWISE)
        raise ValueError(
            f"Strategy.sharding=True: {type(optimizer).__name__} is not known to update every "
            "element on its own (matrix factors, a global line search, per-layer norms of its "
            f"own); sharding supports {names}, and longboat's LARS and LAMB: use one of "
            "them, or set sharding=False"
        )


def group_of(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]
) -> tuple[int | None, ...]:
    """The user's param group of each trained parameter (None: not in the optimizer);
    ValueError for an optimizer parameter the model does not train."""
    position = {id(p): i for i, p in enumerate(params)}
    groups: list[int | None] = [None] * len(params)
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            i = position.get(id(p))
            if i is None:
                raise ValueError(
                    "Strategy.sharding=True: the optimizer holds a parameter of shape "
                    f"{tuple(p.shape)} that is not a trained parameter of the model (frozen, or "
                    "of another module); sharding lays the optimizer out over the model's "
                    "gradient buckets: pass only the model's trainable parameters"
                )
            groups[i] = g
    return tuple(groups)


@dataclass(frozen=True)
class ShardSetup:
    """One world's sharding: what the reducer and the sharded step share."""

    plan: ShardingPlan
    groups: ShardGroups
    buckets: BucketPlan
    """The reducer's buckets, which the slices cut."""
    layout: ShardLayout
    """This rank's slice of every bucket, cut into pieces of parameters."""
    group_of: tuple[int | None, ...]
    """The user's param group of each trained parameter (None: not in the optimizer)."""
    scatter: SliceScatter | None
    """Stage 2: the reducer's bucket collective, holding this rank's gradient slices."""

    @classmethod
    def make(
        cls,
        plan: ShardingPlan,
        groups: ShardGroups,
        params: Sequence[nn.Parameter],
        buckets: BucketPlan,
        optimizer: torch.optim.Optimizer | None,
        *,
        wire_dtype: torch.dtype | None = None,
    ) -> ShardSetup:
        """Lay ``params`` out over ``buckets`` for this rank of ``groups`` (no communication);
        ValueError without an optimizer, or with one sharding cannot step."""
        if optimizer is None:
            raise ValueError("sharding splits the optimizer's state: pass the optimizer")
        check_elementwise(optimizer)
        groups_of = group_of(optimizer, params)
        layout = ShardLayout.build(params, buckets.buckets, groups_of, groups.degree, groups.index)
        scatter = None
        if plan.stage == 2:
            world = dist.get_world_size()
            scatter = SliceScatter(layout, groups, world_size=world, wire_dtype=wire_dtype)
        return cls(plan, groups, buckets, layout, groups_of, scatter)
