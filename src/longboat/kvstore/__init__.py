"""MXNet's KVStore, in PyTorch, on longboat's parameter servers.

    import longboat.kvstore as kvstore          # was: import mxnet as mx; kv = mx.kv.create(...)
    kv = kvstore.create("dist_sync")
    kv.init(3, torch.ones(2, 3))               # dist: worker 0's value wins, then a barrier
    kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.1))   # servers update: update_on_kvstore
    kv.push(3, [g0, g1])                       # a list (one per device) is summed first
    kv.pull(3, out=w)                          # dist_sync: after every worker's push is applied

Types (``TYPES``, MXNet's names): "local", "local_update_cpu", "local_allreduce_cpu",
"device", "local_allreduce_device" and "nccl" keep the store in this process (device types and
nccl sum lists on the first value's device); "dist_sync", "dist_device_sync" (alias
"dist_sync_device") and "dist_async" use the job's parameter servers
(``longboat launch --servers N --workers M script.py``). As in MXNet, one step's pushes of all
workers are *summed* (scale with ``rescale_grad``); without an optimizer the stored value
becomes that sum (sync) or the latest push (async). In a server process ``create("dist_*")``
serves until every worker has finished, then exits: the same script runs in every role.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from collections.abc import Sequence

from longboat.kvstore import optimizer
from longboat.kvstore.errors import (
    InvalidArgumentError,
    KeyNotInitError,
    MXNetError,
    NotSupportedError,
)
from longboat.kvstore.optimizer import Optimizer
from longboat.kvstore.sparse import RowSparse, row_sparse_array
from longboat.kvstore.store import KVStore
from longboat.kvstore.types import TYPES, kind_of
from longboat.ps.server.local import LocalServers
from longboat.ps.trainer.kv import KVClient


def create(
    name: str = "local",
    *,
    servers: Sequence[str] | None = None,
    token: str | None = None,
    rank: int | None = None,
    num_workers: int | None = None,
    timeout: float | None = None,
) -> KVStore:
    """A store of type ``name`` (one of ``TYPES``; "horovod" and "byteps" are refused with the
    reason). Dist types read the servers, this worker's rank and the worker count from
    ``longboat launch``'s environment unless given. In a server process of
    ``longboat launch --servers N`` this serves until the workers finish and then exits."""
    kind = kind_of(name)
    if not kind.dist:
        return KVStore(name, KVClient(LocalServers(1), reduce="sum"), 0, 1)
    from longboat.launch.roles import is_server
    from longboat.ps.shared import auth
    from longboat.ps.trainer.engine import cluster_from_env

    if servers is None and is_server():
        from longboat.ps.server import run_server

        run_server()
        # end here, as the launcher's server watch does: an interpreter shutdown with gRPC's
        # threads still winding down can abort (std::terminate) after a correct run
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if servers is None or rank is None or num_workers is None:
        env_servers, env_rank, env_workers = cluster_from_env()
        servers = env_servers if servers is None else servers
        rank = env_rank if rank is None else rank
        num_workers = env_workers if num_workers is None else num_workers
    client = KVClient(
        servers,
        token or auth.load_token(),
        trainer=rank,
        trainers=num_workers,
        sync=kind.sync,
        reduce="sum",
        timeout=timeout,
    )
    store = KVStore(name, client, rank, num_workers)
    atexit.register(store.close)
    return store


from longboat.kvstore.trainer import Trainer  # noqa: E402 - it needs create and KVStore

__all__ = [
    "TYPES",
    "InvalidArgumentError",
    "KVStore",
    "KeyNotInitError",
    "MXNetError",
    "NotSupportedError",
    "Optimizer",
    "RowSparse",
    "Trainer",
    "create",
    "optimizer",
    "row_sparse_array",
]
