"""The process groups of sharding: the ranks a state is split over, and the ranks that hold
the same shard (when ``sharding_degree`` is below the world size), and their collectives.

Where a group's ranks share one node and its backend is Gloo (CPU tensors), its collectives go
through shared memory (`longboat.comm.algorithms.shm`: the reduce-scatter and all-gather halves
of longboat's shm allreduce, on a worker thread) instead of Gloo's TCP loopback; a tensor shm
cannot take (on a GPU, of another dtype) still goes to the backend, as does every collective
of a group spread over nodes or on NCCL.

A group over the same ranks, in the same order, as the gradient allreduce's first shm
communicator runs on that allreduce (`ShardGroups.make`'s ``shared``): its segments and its
worker thread, so no second set of segments is mapped. One worker runs one collective at a
time, in the order they were queued, and every rank queues them in the same order: the
reducer's during backward (all waited for before the step reads the gradients), sharding's
from the training thread (all-gathers in the step or the next forward, each written before
the forward ends; stage 2's reduce-scatters in backward, in bucket order).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeGuard

import torch
import torch.distributed as dist

from longboat import cluster
from longboat.comm.algorithms import Handle
from longboat.comm.algorithms.shm import SUPPORTED, ShmAllreduce, ShmComm, check_one_node
from longboat.comm.handles import FutureHandle
from longboat.comm.placed import PlacedSlices
from longboat.comm.shm_segment import shm_dir

# torch 2.13 renamed the flat-tensor collectives; both names work on Gloo and NCCL
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class ShardGroups:
    """This rank is ``index`` of the ``degree`` ranks of ``shard``; ``replicas`` joins the
    ranks of the other shard groups that own the same slices (None: one shard group).
    ``shard_shm``/``replicas_shm``: the group's shared-memory collectives where they apply."""

    degree: int
    index: int
    shard: dist.ProcessGroup
    replicas: dist.ProcessGroup | None
    shard_shm: ShmAllreduce | None = None
    replicas_shm: ShmAllreduce | None = None

    @classmethod
    def make(cls, degree: int, shared: Sequence[object] = ()) -> ShardGroups:
        """Shard groups of ``degree`` consecutive ranks (collective: every rank, same order).

        ``shared``: the gradient allreduce's functions, one per communicator; a group over the
        ranks of an shm one runs on it instead of mapping segments of its own (module doc)."""
        world, rank = dist.get_world_size(), dist.get_rank()
        if degree == world:
            shard = cluster.new_group()
            return cls(degree, rank, shard, None, shared_memory(shard, shared))
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
        # each group's shm is built by its own ranks only: shard groups first, on every rank
        shard_shm = shared_memory(shard, shared)
        replicas_shm = shared_memory(replicas, shared)
        return cls(degree, rank % degree, shard, replicas, shard_shm, replicas_shm)

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor) -> Handle:
        """Start summing ``full`` over the shard group into this rank's slice ``output``."""
        if _usable(self.shard_shm, output, full):
            return self.shard_shm.reduce_scatter(output, full)
        return _reduce_scatter(output, full, group=self.shard, async_op=True)

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> Handle:
        """Start gathering every rank's ``shard`` into ``full`` (slices in rank order)."""
        if _usable(self.shard_shm, shard, full):
            return self.shard_shm.all_gather(full, shard)
        return _all_gather(full, shard, group=self.shard, async_op=True)

    def all_gather_placed(self, slices: PlacedSlices) -> Handle | None:
        """Start gathering slices that live in pieces straight into their places
        (`ShmComm.all_gather_placed`), or None where only `all_gather` applies (no shared
        memory for this group, or a tensor shm cannot take)."""
        if not _usable(self.shard_shm, *slices.tensors()):
            return None
        return self.shard_shm.all_gather_placed(slices)

    def sum_over_replicas(self, tensor: torch.Tensor) -> Handle | None:
        """Start summing ``tensor`` over the ranks that own the same slices; None if alone."""
        if self.replicas is None:
            return None
        if _usable(self.replicas_shm, tensor):
            return FutureHandle(self.replicas_shm(tensor))
        return dist.all_reduce(tensor, group=self.replicas, async_op=True)


def shared_memory(group: dist.ProcessGroup, shared: Sequence[object] = ()) -> ShmAllreduce | None:
    """``group``'s shared-memory collectives: the first open shm allreduce of ``shared`` over
    the same ranks in the same order, else new ones; None where they do not apply: one rank,
    a backend other than Gloo, ranks on several nodes, no shared-memory directory (collective
    over ``group``: every rank of it decides alike)."""
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) == 1 or dist.get_backend(group) != "gloo":
        return None
    for fn in shared:
        if isinstance(fn, ShmAllreduce) and not fn.closed and fn.comm.ranks == ranks:
            return fn
    if not shm_dir().is_dir():
        return None
    try:
        check_one_node(group, ranks, torch.device("cpu"))
    except ValueError:
        return None
    return ShmAllreduce(ShmComm(group))


def _usable(shm: ShmAllreduce | None, *tensors: torch.Tensor) -> TypeGuard[ShmAllreduce]:
    """Whether ``shm`` takes ``tensors``: open (``lb.shutdown`` closes it while a group that
    longboat adopted lives on, e.g. for Lightning's checkpoint after ``fit``) and fitting."""
    return shm is not None and not shm.closed and _fits(*tensors)


def _fits(*tensors: torch.Tensor) -> bool:
    """Tensors the shm collectives take: contiguous, on the CPU, of a dtype they sum."""
    return all(
        t.device.type == "cpu" and t.is_contiguous() and t.dtype in SUPPORTED for t in tensors
    )
