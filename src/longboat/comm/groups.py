"""Communicators: independent process groups over the same ranks (`nccl_comm_num`)."""

from __future__ import annotations

import torch.distributed as dist

from longboat import cluster


def make_communicators(count: int, ranks: list[int] | None = None) -> list[dist.ProcessGroup]:
    """Create ``count`` independent process groups over ``ranks`` (default: every rank).

    Every rank must call this with the same arguments in the same order, as with any
    ``new_group``. Each group has its own connections (Gloo) or communicator and stream
    (NCCL), so collectives issued on different groups can be in flight at the same time.
    Like every group longboat makes, each is bounded by the job's timeout.
    """
    if count < 1:
        raise ValueError(f"need at least one communicator, got {count}")
    return [cluster.new_group(ranks) for _ in range(count)]
