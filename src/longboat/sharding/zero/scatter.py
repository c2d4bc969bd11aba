"""Stage 2's bucket collective: each packed bucket is reduce-scattered into this rank's slice.

`SliceScatter` is what the reducer (`longboat.collective.reducer.Reducer`) runs per bucket
under stage 2 instead of the allreduce: the bucket, padded to ``degree`` equal slices, is
reduce-scattered on the shard group into this rank's slice (`slices`, one per bucket, where
the sharded step reads its gradients), overlapped with the rest of backward as the allreduce
is. The full buffers live from packing to the end of backward only. With ``sharding_degree``
below the world size, each slice is then summed over the ranks owning the same slice.

The AMP overflow check runs on the slices and is combined over the shard group, so every rank
skips the same steps; clipping takes the norm over every rank's slices.

With ``wire_dtype`` (``fp16_allreduce``, ``gradient_compression`` 'fp16' or 'bf16') the packed
bucket is cast to it, reduce-scattered in it (half the bytes), and the slice cast back; the
sum over the replica group, when there is one, runs on the full-precision slice.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from longboat.comm.algorithms import Handle
from longboat.comm.compress import ring_bytes
from longboat.comm.handles import wait_for
from longboat.sharding.zero.clip import clip_shards_
from longboat.sharding.zero.groups import ShardGroups
from longboat.sharding.zero.layout import ShardLayout

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


class SliceScatter:
    """Reduce-scatter each bucket into this rank's slice of ``layout`` (a `BucketCollective`);
    see the module doc."""

    name = "reduce-scatter"
    keeps_buffers = False

    def __init__(
        self,
        layout: ShardLayout,
        groups: ShardGroups,
        *,
        world_size: int,
        wire_dtype: torch.dtype | None = None,
    ) -> None:
        self.layout, self.groups = layout, groups
        self.world_size = world_size
        self.wire_dtype = wire_dtype
        self.slices = [
            torch.zeros(s.shard_numel, dtype=s.dtype, device=s.device) for s in layout.buckets
        ]
        """This rank's slice of each bucket's averaged gradients."""
        self.bytes_sent = 0
        """Gradient bytes this rank sent in its reduce-scatters (``S·(d−1)/d`` each, ``S`` on
        the wire) and the sums over the replica groups (a ring allreduce of the slice)."""

    def buffer(self, bucket: int) -> torch.Tensor:
        """Bucket ``bucket``'s full buffer, padded to ``degree`` slices (the padding zeroed)."""
        shard = self.layout.buckets[bucket]
        full = torch.empty(
            shard.shard_numel * self.groups.degree, dtype=shard.dtype, device=shard.device
        )
        full[shard.numel :].zero_()
        return full

    def launch(self, bucket: int, comm: int, buffer: torch.Tensor) -> Handle:
        out = self.slices[bucket]
        self.bytes_sent += self._bytes_sent(out)
        if self.wire_dtype is not None and self.wire_dtype != out.dtype:
            full = buffer.to(self.wire_dtype)
            low = torch.empty(out.numel(), dtype=self.wire_dtype, device=out.device)
            return _Finish(self.groups.reduce_scatter(low, full), self.groups, out, (full, low))
        scatter = self.groups.reduce_scatter(out, buffer)
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

    def all_finite(self, buffers: Sequence[torch.Tensor]) -> torch.Tensor:
        """Whether every rank's slices are finite: combined over the shard group (MIN)."""
        local = torch.stack([torch.isfinite(g).all() for g in self.slices]).all()
        flag = local.to(torch.float32).reshape(1)
        wait_for(
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.groups.shard, async_op=True)
        )
        return flag[0] > 0

    def clip_grad_norm_(
        self, params: Sequence[torch.Tensor], max_norm: float, norm_type: float
    ) -> torch.Tensor:
        """Clip the slices by the norm over every rank's slices (the global norm)."""
        return clip_shards_(self.slices, max_norm, norm_type, self.groups.shard)
