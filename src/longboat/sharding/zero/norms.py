"""Whole-parameter norms for layer-wise optimizers (LARS, LAMB) whose parameters are sliced.

A layer-wise optimizer scales each parameter's update by a ratio of two norms of the whole
parameter (`longboat.optim.layerwise`). Under sharding it steps slices, so the squared norms
of every slice are summed per parameter over the shard group: one small allreduce per step,
``[parameters, 2]``, before any slice is updated.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from longboat.comm.handles import wait_for


class ShardNormSum:
    """``norm_sum`` of a layer-wise optimizer over shard parameters: ``param_of[id(slice)]``
    is the model parameter a slice belongs to, of ``count``; ``group``: the shard group."""

    def __init__(
        self,
        param_of: dict[int, int],
        count: int,
        dtype: torch.dtype,
        device: torch.device,
        group: dist.ProcessGroup,
    ) -> None:
        self.param_of, self.count, self.group = param_of, count, group
        self.dtype, self.device = dtype, device  # the same on every rank of the group
        self._index: dict[tuple[int, ...], torch.Tensor] = {}

    @classmethod
    def wide_enough(cls, params: Sequence[torch.Tensor]) -> torch.dtype:
        """float64 if any parameter is, else float32: every rank sums in the same dtype."""
        return torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32

    def __call__(self, slices: list[torch.Tensor], squares: torch.Tensor) -> torch.Tensor:
        """``squares[i]`` of ``slices[i]`` summed with every rank's slices of the same
        parameter (collective: every rank of the group calls it once per step)."""
        key = tuple(id(s) for s in slices)
        index = self._index.get(key)
        if index is None:  # made once per set of slices: no host copy per step
            rows = [self.param_of[id(s)] for s in slices]
            index = self._index[key] = torch.tensor(rows, dtype=torch.long, device=self.device)
        total = torch.zeros(self.count, 2, dtype=self.dtype, device=self.device)
        total.index_add_(0, index, squares.to(device=self.device, dtype=self.dtype))
        wait_for(dist.all_reduce(total, group=self.group, async_op=True))
        return total.index_select(0, index)
