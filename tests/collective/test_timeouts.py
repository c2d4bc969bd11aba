"""Every process group longboat creates carries the job's timeout (torch's default is 30 min)."""

from __future__ import annotations

import torch
from torch import nn

from tests._dist import run_ranks


def _group_timeouts(rank: int, world: int) -> list[float]:
    import torch.distributed as dist

    import longboat as lb
    import longboat.horovod.torch as hvd
    from longboat.comm.algorithms.hierarchical import build_groups

    lb.init()
    model = nn.Linear(4, 2)
    lb.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), lb.Strategy(nccl_comm_num=2))
    build_groups(dist.group.WORLD, list(range(world)), [[0, 1], [2, 3]])  # intra + inter groups
    hvd.init()  # the Horovod facade's negotiation and data groups
    cpu = torch.device("cpu")
    timeouts = [
        pg._get_backend(cpu).options._timeout.total_seconds()
        for pg in dist.distributed_c10d._world.pg_map
    ]
    hvd.shutdown()
    return timeouts


def test_every_group_carries_the_job_timeout() -> None:
    results = run_ranks(_group_timeouts, 4, timeout=120, env={"LONGBOAT_TIMEOUT": "45"})
    for timeouts in results:
        # this rank's groups: world, 2 communicators, its intra and inter group, 2 of Horovod's
        assert len(timeouts) == 7, timeouts
        assert set(timeouts) == {45.0}, timeouts
