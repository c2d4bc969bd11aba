"""Gradient clipping by the global norm when each rank holds only a slice of the gradients."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from longboat.comm.handles import wait_for


def clip_shards_(
    shards: Sequence[torch.Tensor],
    max_norm: float,
    norm_type: float,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """Scale ``shards`` in place as ``torch.nn.utils.clip_grad_norm_`` would scale the whole
    gradients: the norm is taken over every rank's shards of ``group`` (zero padding adds
    nothing). Returns the total norm (on the device; nothing here blocks a GPU host)."""
    p = float(norm_type)
    norms = torch._foreach_norm(list(shards), p)
    local = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), p)
    if p == float("inf"):
        wait_for(dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group, async_op=True))
        total = local
    else:
        powered = local.pow(p)
        wait_for(dist.all_reduce(powered, op=dist.ReduceOp.SUM, group=group, async_op=True))
        total = powered.pow(1.0 / p)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for shard in shards:
        shard.mul_(coef.to(shard.dtype))
    return total
