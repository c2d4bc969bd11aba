"""Stage 2: gradient buckets are reduce-scattered during backward; each rank keeps its slice.

`ShardedReducer` is the `Reducer` with another collective per bucket: the packed bucket (padded
to ``degree`` equal slices) is reduce-scattered on the shard group into this rank's slice,
overlapped with the rest of backward as the allreduce is. When backward ends the full bucket
buffers and the parameters' ``.grad`` are released: what remains of the gradients is one
slice per bucket (`grad_shards`), which the sharded step reads. With ``sharding_degree`` below
the world size, each slice is then summed over the ranks owning the same slice.

The used-parameter flags travel apart (an allreduce of their own), and the AMP overflow check
runs on the slices and is combined over the shard group, so every rank skips the same steps.

With ``wire_dtype`` (``fp16_allreduce``, ``gradient_compression`` 'fp16' or 'bf16') the packed
bucket is cast to it, reduce-scattered in it (half the bytes), and the slice cast back; the
sum over the replica group, when there is one, runs on the full-precision slice.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from longboat.collective.buckets import BucketPlan
from longboat.collective.reducer import Reducer, _Bucket
from longboat.collective.sharding.clip import clip_shards_
from longboat.collective.sharding.groups import ShardGroups
from longboat.collective.sharding.layout import ShardLayout
from longboat.comm.algorithms import AllreduceFn, Handle
from longboat.comm.compress import ring_bytes
from longboat.comm.handles import wait_for

WIRE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
"""The compressors a stage-2 reduce-scatter carries out itself: their wire dtype."""


class _Finish:
    """A bucket's reduce-scatter, then (inside ``wait``, ordered after it) the cast of a
    low-precision slice back into the gradient slice and the sum over the replica group."""

    def __init__(
        self,
        scatter: Handle,
        groups: ShardGroups,
        shard: torch.Tensor,
        wire: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        self._scatter, self._groups, self._shard, self._wire = scatter, groups, shard, wire

    def wait(self) -> object:
        wait_for(self._scatter)
        if self._wire is not None:
            self._shard.copy_(self._wire[1])
            self._wire = None  # the low-precision buffers go now
        handle = self._groups.sum_over_replicas(self._shard)
        return wait_for(handle) if handle is not None else True


class ShardedReducer(Reducer):
    """A `Reducer` that reduce-scatters its buckets (sharding stage 2); see the module doc."""

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        plan: BucketPlan,
        allreduce_fns: Sequence[AllreduceFn],
        *,
        world_size: int,
        groups: ShardGroups,
        check_finite: bool = False,
        wire_dtype: torch.dtype | None = None,
    ) -> None:
        # the flags go apart, through the allreduce functions: the buckets are scattered
        super().__init__(
            named_params,
            plan,
            allreduce_fns,
            world_size=world_size,
            check_finite=check_finite,
            flag_fns=allreduce_fns,
        )
        self.groups = groups
        self.wire_dtype = wire_dtype
        self.bytes_scattered = 0
        """Gradient bytes this rank sent in its reduce-scatters (``S·(d−1)/d`` each, ``S`` on
        the wire) and the sums over the replica groups (a ring allreduce of the slice)."""
        self.layout = ShardLayout.build(
            self.params, plan.buckets, [0] * len(self.params), groups.degree, groups.index
        )
        self.grad_shards = [
            torch.zeros(s.shard_numel, dtype=s.dtype, device=s.device) for s in self.layout.buckets
        ]
        for bucket in self._buckets:
            self._release(bucket)

    # -- the Reducer's steps, sharded ---------------------------------------------------------

    def _pack(self, bucket: _Bucket) -> None:
        """Allocate the padded bucket, pack it, and let go of the parameters' ``.grad``."""
        shard = self.layout.buckets[bucket.index]
        full = shard.shard_numel * self.groups.degree
        bucket.buffer = torch.empty(full, dtype=shard.dtype, device=shard.device)
        bucket.buffer[shard.numel :].zero_()
        for i in bucket.members:
            self._slots[i] = self._slot_view(i)
        super()._pack(bucket)
        for i in bucket.members:
            self.params[i].grad = None

    def _collective(self, bucket: _Bucket) -> Handle:
        out = self.grad_shards[bucket.index]
        self.bytes_scattered += self._bytes_sent(out)
        if self.wire_dtype is not None and self.wire_dtype != out.dtype:
            full = bucket.buffer.to(self.wire_dtype)
            low = torch.empty(out.numel(), dtype=self.wire_dtype, device=out.device)
            return _Finish(self.groups.reduce_scatter(low, full), self.groups, out, (full, low))
        scatter = self.groups.reduce_scatter(out, bucket.buffer)
        if self.groups.replicas is None:
            return scatter
        return _Finish(scatter, self.groups, out, None)

    def _bytes_sent(self, out: torch.Tensor) -> int:
        """What one bucket's reduce-scatter (and replica sum) sends from this rank."""
        size = (self.wire_dtype or out.dtype).itemsize
        degree = self.groups.degree
        sent = out.numel() * size * (degree - 1)
        if self.groups.replicas is not None:
            replicas = self.world_size // degree
            sent += ring_bytes(out.numel() * out.element_size(), replicas)
        return sent

    def _finite_flag(self) -> torch.Tensor:
        """Whether every rank's slices are finite: combined over the shard group (MIN)."""
        local = torch.stack([torch.isfinite(g).all() for g in self.grad_shards]).all()
        flag = local.to(torch.float32).reshape(1)
        wait_for(
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.groups.shard, async_op=True)
        )
        return flag[0] > 0

    def _write_back(self, used_on: list[int] | None) -> None:
        """No ``.grad`` to point anywhere: release the full buckets, keep the slices."""
        for bucket in self._buckets:
            self._release(bucket)

    def _release(self, bucket: _Bucket) -> None:
        """Drop the full buffer: its handle (which holds it) and every view of it."""
        bucket.handle = None
        bucket.buffer = bucket.buffer.new_empty(0)
        for i in bucket.members:
            self._slots[i] = bucket.buffer  # replaced by the next _pack

    # -- what the sharded step and the model read -----------------------------------------------

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients by their norm over every rank's slices (the global norm)."""
        return clip_shards_(self.grad_shards, max_norm, norm_type, self.groups.shard)
