"""MXNet's KVStore, in PyTorch, on longboat's parameter servers.

    import longboat.kvstore as kvstore          # was: import mxnet as mx; kv = mx.kv.create(...)
    kv = kvstore.create("dist_sync")
    kv.init(3, torch.ones(2, 3))               # dist: worker 0's value wins, then a barrier
    kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.1))   # servers update: update_on_kvstore
    kv.push(3, [g0, g1])                       # a list (one per device) is summed first
    kv.pull(3, out=w)                          # dist_sync: after every worker's push is applied

Types: "local" and "device" keep the store in this process (device: lists are summed on the
first value's device); "dist_sync", "dist_device_sync" and "dist_async" use the job's parameter
servers (``longboat launch --servers N --workers M script.py``). As in MXNet, one step's pushes
of all workers are *summed* (scale with ``rescale_grad``); without an optimizer the stored value
becomes that sum (sync) or the latest push (async). In a server process ``create("dist_*")``
serves until every worker has finished, then exits: the same script runs in every role.
"""

from __future__ import annotations

import atexit
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from longboat.kvstore import optimizer
from longboat.kvstore.optimizer import Optimizer, as_optimizer
from longboat.log import get_logger
from longboat.ps.client import PSError
from longboat.ps.kv import KVClient
from longboat.ps.local import LocalServers

TYPES = ("local", "device", "dist_sync", "dist_device_sync", "dist_async")
Key = int | str
Value = torch.Tensor | Sequence[torch.Tensor]
Updater = Callable[[Key, torch.Tensor, torch.Tensor], None]
log = get_logger("longboat.kvstore")


class KVStore:
    """A key-value store of tensors (use ``create``)."""

    def __init__(self, kind: str, client: KVClient, rank: int, num_workers: int) -> None:
        self._type, self._kv = kind, client
        self._rank, self._num_workers = rank, num_workers
        self._keys: dict[str, Key] = {}
        self._optimizer: Optimizer | None = None
        self._updater: Updater | None = None
        self._closed = False

    # ---- who and what -------------------------------------------------------------------
    @property
    def type(self) -> str:
        return self._type

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def num_workers(self) -> int:
        return self._num_workers

    @property
    def update_on_kvstore(self) -> bool:
        """True once ``set_optimizer`` made the store (the servers, for dist) run the update."""
        return self._optimizer is not None

    def is_capable(self, capability: str) -> bool:
        return capability.lower() == "optimizer"

    # ---- data ---------------------------------------------------------------------------
    def init(self, key: Key | Sequence[Key], value: Value | Sequence[Value]) -> None:
        """Create each key with its value. Distributed: worker 0's values are stored, then all
        workers meet at a barrier (as MXNet does), so every key exists when ``init`` returns."""
        for name, v in self._pairs("init", key, value):
            self._kv.init(name, v, send_value=self._rank == 0)
        if self._type.startswith("dist"):
            self._kv.barrier()

    def push(
        self, key: Key | Sequence[Key], value: Value | Sequence[Value], priority: int = 0
    ) -> None:
        """Push gradients (with an optimizer) or values; a list per key is summed first.
        ``priority`` is accepted for MXNet compatibility; pushes go out in call order."""
        batch: dict[str, torch.Tensor] = {}
        for name, v in self._pairs("push", key, value):
            if name in batch:
                raise ValueError(f"push: key {name!r} is listed twice; sum its values first")
            if self._updater is not None:
                stored = self._kv.pull(name)
                self._updater(self._keys[name], v, stored)
                batch[name] = stored
            elif self._optimizer is not None and self._optimizer.rescale_grad != 1.0:
                batch[name] = v * self._optimizer.rescale_grad
            else:
                batch[name] = v
        self._kv.push_many(batch)  # one message per server for all the keys

    def pull(
        self,
        key: Key | Sequence[Key],
        out: Value | Sequence[Value] | None = None,
        priority: int = 0,
        ignore_sparse: bool = True,
    ) -> Any:
        """Copy each key's value into ``out`` (a tensor or one per device) and return ``out``;
        without ``out``, return new CPU tensors. dist_sync: waits until every worker's pushes
        of this key up to now are applied."""
        single = isinstance(key, int | str)
        keys = [key] if single else list(key)  # type: ignore[arg-type]
        if single or out is None:
            outs: list[Any] = [out] * len(keys)
        elif isinstance(out, torch.Tensor):
            raise TypeError("pull of a list of keys needs a list of outputs, one per key")
        else:
            outs = list(out)
        if len(outs) != len(keys):
            raise ValueError(f"pull: {len(keys)} keys but {len(outs)} outputs")
        values = self._kv.pull_many([self._name("pull", k) for k in keys])
        results = []
        for k, o in zip(keys, outs, strict=True):
            value = values[str(k)]
            if o is None:
                results.append(value)
                continue
            for target in [o] if isinstance(o, torch.Tensor) else o:
                if target.shape != value.shape:
                    raise ValueError(
                        f"pull {k!r}: out has shape {tuple(target.shape)}, the key holds "
                        f"{tuple(value.shape)}"
                    )
                target.copy_(value)
            results.append(o)
        return results[0] if single else results

    def pushpull(
        self,
        key: Key | Sequence[Key],
        value: Value | Sequence[Value],
        out: Value | Sequence[Value] | None = None,
        priority: int = 0,
    ) -> Any:
        """``push`` then ``pull``; without ``out`` the result is written into ``value``."""
        self.push(key, value, priority)
        return self.pull(key, value if out is None else out, priority)

    # ---- updates ------------------------------------------------------------------------
    def set_optimizer(self, optimizer: Optimizer | torch.optim.Optimizer) -> None:
        """Let the store apply ``optimizer`` to pushed gradients (on the servers for dist
        types): for every key, created before or after. Every worker calls it (MXNet's rule);
        worker 0 reconfigures existing keys, then all meet at a barrier."""
        opt = as_optimizer(optimizer)
        self._optimizer, self._updater = opt, None
        self._kv.set_optimizer(opt.name, opt.hparams)
        if self._rank == 0:
            self._kv.reconfigure()
        if self._type.startswith("dist"):
            self._kv.barrier()

    def set_updater(self, updater: Updater) -> None:
        """Local types: ``updater(key, pushed, stored)`` changes ``stored`` in place on push."""
        if self._type.startswith("dist"):
            raise RuntimeError(
                f"set_updater runs Python in this process, which a {self._type} store cannot "
                "ship to its servers: use set_optimizer(kvstore.optimizer.SGD(...)) (or a "
                "torch SGD/Adam/Adagrad), which the servers run"
            )
        self._updater, self._optimizer = updater, None
        self._kv.set_optimizer(None)
        self._kv.reconfigure()

    _set_updater = set_updater

    def barrier(self) -> None:
        """Wait for every worker (a no-op for local types)."""
        if self._type.startswith("dist"):
            self._kv.barrier()

    _barrier = barrier

    def close(self) -> None:
        """Dist: tell the servers this worker is done (also run at interpreter exit)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._kv.stop()
        except PSError as exc:  # the servers may be gone already: nothing left to tell them
            log.warning("kvstore close: could not tell the servers this worker stopped: %s", exc)
        finally:
            self._kv.close()

    # ---- helpers ------------------------------------------------------------------------
    def _name(self, what: str, key: Key) -> str:
        if not isinstance(key, int | str) or isinstance(key, bool):
            raise TypeError(f"{what}: keys are int or str, got {type(key).__name__}")
        name = str(key)
        if what == "init":
            self._keys[name] = key
        elif name not in self._keys:
            raise KeyError(f"{what} of key {key!r}, which was not init()-ed: call kv.init first")
        return name

    def _merge(self, what: str, key: Key, value: Value) -> torch.Tensor:
        """One tensor from a tensor or a per-device list (summed: CPU for local types, the
        first value's device for device types)."""
        if isinstance(value, torch.Tensor):
            return value.detach()
        parts = [v.detach() for v in value]
        if not parts or not all(isinstance(v, torch.Tensor) for v in parts):
            raise TypeError(f"{what} {key!r}: give a tensor or a non-empty list of tensors")
        if any(v.shape != parts[0].shape for v in parts):
            shapes = [tuple(v.shape) for v in parts]
            raise ValueError(f"{what} {key!r}: per-device values differ in shape {shapes}")
        where = parts[0].device if "device" in self._type else torch.device("cpu")
        total = parts[0].to(where, copy=True)
        for v in parts[1:]:
            total += v.to(where)
        return total

    def _pairs(
        self, what: str, key: Key | Sequence[Key], value: Value | Sequence[Value]
    ) -> list[tuple[str, torch.Tensor]]:
        if isinstance(key, int | str):
            return [(self._name(what, key), self._merge(what, key, value))]  # type: ignore[arg-type]
        keys, values = list(key), list(value)  # type: ignore[arg-type]
        if len(keys) != len(values):
            raise ValueError(f"{what}: {len(keys)} keys but {len(values)} values")
        return [
            (self._name(what, k), self._merge(what, k, v))
            for k, v in zip(keys, values, strict=True)
        ]


def create(
    name: str = "local",
    *,
    servers: Sequence[str] | None = None,
    token: str | None = None,
    rank: int | None = None,
    num_workers: int | None = None,
    timeout: float | None = None,
) -> KVStore:
    """A store of type ``name`` (one of ``TYPES``). Dist types read the servers, this worker's
    rank and the worker count from ``longboat launch``'s environment unless given. In a
    server process of ``longboat launch --servers N`` this serves until the workers finish and
    then exits the process."""
    if name not in TYPES:
        raise ValueError(f"unknown KVStore type {name!r}; choose one of {', '.join(TYPES)}")
    if not name.startswith("dist"):
        return KVStore(name, KVClient(LocalServers(1), reduce="sum"), 0, 1)
    from longboat.launch.roles import is_server
    from longboat.ps import auth
    from longboat.ps.engine import cluster_from_env

    if servers is None and is_server():
        from longboat.ps.server import run_server

        run_server()
        sys.exit(0)
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
        sync=name != "dist_async",
        reduce="sum",
        timeout=timeout,
    )
    store = KVStore(name, client, rank, num_workers)
    atexit.register(store.close)
    return store


from longboat.kvstore.trainer import Trainer  # noqa: E402 - it needs create and KVStore

__all__ = ["TYPES", "KVStore", "Optimizer", "Trainer", "create", "optimizer"]
