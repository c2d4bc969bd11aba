"""The process groups of sharding: the ranks a state is split over, and the ranks that hold
the same shard (when ``sharding_degree`` is below the world size), and their collectives."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from longboat import cluster
from longboat.comm.algorithms import Handle

# torch 2.13 renamed the flat-tensor collectives; both names work on Gloo and NCCL
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class ShardGroups:
    """This rank is ``index`` of the ``degree`` ranks of ``shard``; ``replicas`` joins the
    ranks of the other shard groups that own the same slices (None: one shard group)."""

    degree: int
    index: int
    shard: dist.ProcessGroup
    replicas: dist.ProcessGroup | None

    @classmethod
    def make(cls, degree: int) -> ShardGroups:
        """Shard groups of ``degree`` consecutive ranks (collective: every rank, same order)."""
        world, rank = dist.get_world_size(), dist.get_rank()
        if degree == world:
            return cls(degree, rank, cluster.new_group(), None)
        shard = replicas = None
        for first in range(0, world, degree):
            group = cluster.new_group(list(range(first, first + degree)))
            if first <= rank < first + degree:
                shard = group
        for index in range(degree):
            group = cluster.new_group(list(range(index, world, degree)))
            if rank % degree == index:
                replicas = group
        assert shard is not None and replicas is not None
        return cls(degree, rank % degree, shard, replicas)

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor) -> Handle:
        """Start summing ``full`` over the shard group into this rank's slice ``output``."""
        return _reduce_scatter(output, full, group=self.shard, async_op=True)

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> Handle:
        """Start gathering every rank's ``shard`` into ``full`` (slices in rank order)."""
        return _all_gather(full, shard, group=self.shard, async_op=True)

    def sum_over_replicas(self, tensor: torch.Tensor) -> Handle | None:
        """Start summing ``tensor`` over the ranks that own the same slices; None if alone."""
        if self.replicas is None:
            return None
        return dist.all_reduce(tensor, group=self.replicas, async_op=True)
