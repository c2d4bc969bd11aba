"""A fresh rendezvous store for the ranks of every restart attempt (static rendezvous).

With a static rendezvous (``--master``/``--nnodes N``) torch's agent serves one TCPStore on the
master port for the whole job, and its ranks connect to it as ``MASTER_ADDR:MASTER_PORT``. A
script that calls ``torch.distributed.init_process_group`` itself (plain torch, Lightning,
accelerate) writes its keys there unprefixed, so after a restart the new ranks can read the
dead ranks' addresses and fail to connect ("Gloo connectFullMesh failed ... Connection
refused"). From the first restart on, node 0's agent serves a new store on a free port for
each attempt and every node's agent points its ranks' ``MASTER_PORT`` at it.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import WorkerGroup

KEY = "longboat/worker_store/attempt_{}"


class WorkerStores:
    """The stores node 0's agent serves to its ranks, one per restart attempt (the latest kept
    open while its ranks run)."""

    def __init__(self, timeout: timedelta) -> None:
        self.timeout = timeout
        self._serving: dist.TCPStore | None = None

    def point(self, group: WorkerGroup, attempt: int) -> None:
        """Give ``group``'s ranks attempt ``attempt``'s own store (from the first restart on)."""
        if attempt == 0 or group.store is None or group.master_addr is None:
            return
        key = KEY.format(attempt)
        if group.group_rank == 0:
            self._serving = dist.TCPStore(
                group.master_addr,
                0,  # a free port
                is_master=True,
                wait_for_workers=False,
                timeout=self.timeout,
            )
            group.store.set(key, str(self._serving.port))
        group.master_port = int(group.store.get(key))  # bounded by the agent store's timeout
