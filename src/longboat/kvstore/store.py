"""``KVStore``: MXNet's key-value store API over a ``KVClient`` (servers or in-process)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from longboat.kvstore.args import (
    Key,
    KeyRules,
    Part,
    Value,
    check_same_shape,
    check_shape,
    kind_name,
    merge,
    parse_row_ids,
)
from longboat.kvstore.compression import Compressor, parse_params
from longboat.kvstore.errors import (
    InvalidArgumentError,
    KeyNotInitError,
    MXNetError,
    NotSupportedError,
)
from longboat.kvstore.optimizer import Optimizer, as_optimizer
from longboat.kvstore.sparse import RowSparse, check_rows
from longboat.kvstore.types import kind_of, sums_on_device
from longboat.log import get_logger
from longboat.ps.trainer.client import PSError
from longboat.ps.trainer.kv import KVClient
from longboat.words import plural

Updater = Callable[[Key, torch.Tensor, torch.Tensor], None]
log = get_logger("longboat.kvstore")
_STATES = (
    "save/load_optimizer_states is not supported: the optimizer state lives with the values on "
    "the parameter servers; start them with a checkpoint directory (--checkpoint-dir or "
    "LONGBOAT_PS_CHECKPOINT_DIR), whose checkpoints hold both, or use update_on_kvstore=False "
    "and save the torch optimizer's state_dict()"
)


class KVStore:
    """A key-value store of tensors (use ``longboat.kvstore.create``)."""

    def __init__(self, name: str, client: KVClient, rank: int, num_workers: int) -> None:
        self._type, self._kind, self._kv = name, kind_of(name), client
        self._on_device = sums_on_device(name)
        self._rank, self._num_workers = rank, num_workers
        self._keys: dict[str, Key] = {}
        self._shapes: dict[str, torch.Size] = {}
        self._rules = KeyRules()
        self._optimizer: Optimizer | None = None
        self._updater: Updater | None = None
        self._compress: Compressor | None = None
        self._closed = False

    # ---- who and what -------------------------------------------------------------------
    @property
    def type(self) -> str:
        """The type name given to ``create`` (as MXNet reports it)."""
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
        workers meet at a barrier (as MXNet does), so every key exists when ``init`` returns.

        A key listed twice in one call, or ``init``-ed again, is refused (MXNet: "duplicate
        init of key"), except an int key of a dist store: MXNet's dist store accepts that (a
        second gluon ``Trainer`` on the same store does it), and here it keeps the stored value
        (the shape must match). Nothing is sent when a key is refused."""
        pairs = self._rules.pairs("init", key, value)
        listed = [k for k, _ in pairs]
        for k in listed:
            again = str(k) in self._keys and not (self._kind.dist and isinstance(k, int))
            if again or listed.count(k) > 1:
                raise InvalidArgumentError(f"duplicate init of key {k!r}")
        values = [
            (k, self._merge("init", k, [p.to_dense() if isinstance(p, RowSparse) else p
                                        for p in parts]))
            for k, parts in pairs
        ]  # fmt: skip
        for k, v in values:
            if str(k) in self._keys:
                check_shape("init", k, v.shape, self._shapes[str(k)])
        for k, v in values:
            name = str(k)
            if name in self._keys:
                continue  # a dist int key inited again: the stored value stays
            self._keys[name], self._shapes[name] = k, v.shape
            self._kv.init(name, v, send_value=self._rank == 0)
        if self._kind.dist:
            self._kv.barrier()

    def push(
        self, key: Key | Sequence[Key], value: Value | Sequence[Value], priority: int = 0
    ) -> None:
        """Push gradients (with an optimizer) or values. A list of values for a key (one per
        device), and values of a key listed more than once, are summed first. ``priority`` is
        accepted for MXNet compatibility; pushes go out in call order."""
        grouped: dict[str, list[Part]] = {}
        for k, parts in self._rules.pairs("push", key, value):
            grouped.setdefault(self._known(k), []).extend(parts)
        batch: dict[str, torch.Tensor] = {}
        for name, parts in grouped.items():
            v = self._gradient(name, parts)
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
        of this key up to now are applied. A ``RowSparse`` output is skipped (with a warning)
        when ``ignore_sparse`` (MXNet's default: use ``row_sparse_pull``), else gets every row."""
        keys, outs = self._rules.outputs("pull", key, out)
        values = self._kv.pull_many(list(dict.fromkeys(self._known(k) for k in keys)))
        results = []
        for k, o in zip(keys, outs, strict=True):
            value = values[str(k)]
            if o is None:
                results.append(value)
                continue
            for target in [o] if isinstance(o, torch.Tensor | RowSparse) else o:
                if isinstance(target, RowSparse):
                    if ignore_sparse:
                        log.warning("pull %r: skipped a row_sparse output (row_sparse_pull)", k)
                        continue
                    self._fill_every_row(k, target, value)
                    continue
                check_shape("pull", k, target.shape, value.shape)
                target.copy_(value)
            results.append(o)
        return results[0] if isinstance(key, int | str) else results

    def row_sparse_pull(
        self,
        key: Key | Sequence[Key],
        out: RowSparse | Sequence[Any] | None = None,
        priority: int = 0,
        row_ids: torch.Tensor | Sequence[Any] | None = None,
    ) -> Any:
        """Fill each ``RowSparse`` in ``out`` with the rows ``row_ids`` (1-D, any order,
        repeats allowed) of the key's value: ``out.indices`` becomes the sorted unique ids.
        One ``row_ids`` for several outputs of a key serves them all. Only the rows asked
        travel, from the servers holding them (one message per server for all the keys)."""
        if out is None or row_ids is None:
            raise InvalidArgumentError("row_sparse_pull needs out= and row_ids=")
        keys, outs = self._rules.outputs("row_sparse_pull", key, out)
        single = isinstance(key, int | str)
        if not single and isinstance(row_ids, torch.Tensor):
            raise InvalidArgumentError(
                f"row_sparse_pull of {len(keys)} keys needs a list of row_ids, one per key; "
                "got one tensor"
            )
        ids_per_key = [row_ids] if single else list(row_ids)
        if len(ids_per_key) != len(keys):
            raise InvalidArgumentError(
                f"row_sparse_pull: {plural(len(keys), 'key')} but {len(ids_per_key)} row_ids"
            )
        fills = [
            fill
            for k, o, ids in zip(keys, outs, ids_per_key, strict=True)
            for fill in self._row_targets(k, o, ids)
        ]
        wanted: dict[str, torch.Tensor] = {}
        for k, _, rows in fills:
            name = str(k)
            wanted[name] = torch.cat([wanted[name], rows]) if name in wanted else rows
        union = {name: torch.unique(rows) for name, rows in wanted.items()}
        pulled = self._kv.pull_rows_many(union)  # rows of each key's union of ids, sorted
        for k, target, rows in fills:
            name = str(k)
            data = pulled[name][torch.searchsorted(union[name], rows)]
            target.indices = rows
            target.data = data.to(target.data.device, target.data.dtype)
        return out

    def _row_targets(
        self, key: Key, out: Any, ids: Any
    ) -> list[tuple[Key, RowSparse, torch.Tensor]]:
        """(key, output, its sorted unique row ids) for each output of ``key``: checked
        (RowSparse of the key's shape, ids in range) before anything is pulled."""
        name = self._known(key)
        targets = [out] if isinstance(out, RowSparse) else list(out)
        per_target = [ids] if isinstance(ids, torch.Tensor) else list(ids)
        if len(per_target) == 1:
            per_target = per_target * len(targets)
        if len(per_target) != len(targets):
            raise InvalidArgumentError(
                f"row_sparse_pull {key!r}: {plural(len(targets), 'output')} but "
                f"{len(per_target)} row_ids"
            )
        fills = []
        for target, rows in zip(targets, per_target, strict=True):
            if not isinstance(target, RowSparse):
                raise InvalidArgumentError(
                    f"row_sparse_pull {key!r}: out must be a RowSparse (MXNet's row_sparse "
                    f"storage), got {kind_name(target)}; use pull for a dense output"
                )
            shape = self._shapes[name]
            check_shape("row_sparse_pull", key, torch.Size(target.shape), shape)
            unique = torch.unique(parse_row_ids(key, rows))
            check_rows(unique, shape[0], f"row_sparse_pull {key!r}")
            fills.append((key, target, unique))
        return fills

    def broadcast(
        self, key: Key | Sequence[Key], value: Value | Sequence[Value], out: Any, priority: int = 0
    ) -> Any:
        """MXNet 2's ``broadcast``: ``init`` with worker 0's ``value``, then ``pull`` into
        ``out``."""
        self.init(key, value)
        return self.pull(key, out, priority)

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
        if self._kind.dist:
            self._kv.barrier()

    def _holds(self, key: Key) -> bool:
        """Whether ``key`` was ``init``-ed on this store."""
        return str(key) in self._keys

    def _assign(self, keys: Sequence[Key], values: Sequence[torch.Tensor]) -> None:
        """Dist: overwrite existing ``keys`` with worker 0's ``values``, as if they were new
        (a gluon ``Trainer`` made again on this store). Every worker calls it. An optimizer set
        on the store is dropped first (pushes assign again; ``set_optimizer`` after this starts
        fresh state); sync: worker 0 pushes its values and the others zeros (the servers sum
        them), async: worker 0 alone pushes; then a barrier. No compression, no rescale."""
        batch: dict[str, torch.Tensor] = {}
        for k, v in zip(keys, values, strict=True):
            name = self._known(k)
            check_shape("init", k, v.shape, self._shapes[name])
            batch[name] = v.detach().cpu() if self._rank == 0 else torch.zeros_like(v, device="cpu")
            if self._compress is not None:
                self._compress.residuals.pop(name, None)  # a fresh key has no residual
        if self._optimizer is not None:
            self._optimizer = None
            self._kv.set_optimizer(None)
            if self._rank == 0:
                self._kv.reconfigure()
            self._kv.barrier()
        if self._kind.sync or self._rank == 0:
            self._kv.push_many(batch)
        self._kv.barrier()

    def _set_rescale_grad(self, rescale_grad: float) -> None:
        """The optimizer's gradient scale (applied on this worker, so it may change per step)."""
        if self._optimizer is None:
            raise MXNetError("no optimizer is set on this store")
        if rescale_grad != self._optimizer.rescale_grad:
            self._optimizer = dataclasses.replace(self._optimizer, rescale_grad=rescale_grad)

    def set_updater(self, updater: Updater) -> None:
        """Local types: ``updater(key, pushed, stored)`` changes ``stored`` in place on push."""
        if self._kind.dist:
            raise MXNetError(
                f"set_updater runs Python in this process, which a {self._type} store cannot "
                "ship to its servers: use set_optimizer(kvstore.optimizer.SGD(...)) (or a "
                "torch SGD/Adam/Adagrad), which the servers run"
            )
        self._updater, self._optimizer = updater, None
        self._kv.set_optimizer(None)
        self._kv.reconfigure()

    _set_updater = set_updater

    def set_gradient_compression(self, compression_params: Mapping[str, Any]) -> None:
        """MXNet's 2-bit or 1-bit compression of pushes (``{'type': '2bit', 'threshold': t}``,
        ``'1bit'``) with error feedback (``longboat.kvstore.compression``). As in MXNet, only types with 'dist'
        or 'device' in the name accept it; dist stores quantize each worker's (device-summed)
        push, device stores each device's value (even a single one) before summing."""
        if not self._kind.compression:
            raise MXNetError("Gradient compression is not supported for this type of kvstore")
        parsed = parse_params(compression_params)
        self._compress = Compressor(*parsed) if parsed is not None else None

    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        """Refused: the optimizer state lives in the servers' blocks."""
        raise NotSupportedError(_STATES)

    def load_optimizer_states(self, fname: str) -> None:
        """Refused: the optimizer state lives in the servers' blocks."""
        raise NotSupportedError(_STATES)

    def barrier(self) -> None:
        """Wait for every worker (a no-op for local types)."""
        if self._kind.dist:
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
    def _gradient(self, name: str, parts: list[Part]) -> torch.Tensor:
        """One pushed tensor from a key's parts: row-sparse parts made dense, compressed as
        MXNet does for this store type, summed."""
        key = self._keys[name]
        if any(isinstance(p, RowSparse) for p in parts):
            self._check_sparse_push(key)
        dense = [p.to_dense() if isinstance(p, RowSparse) else p for p in parts]
        check_same_shape("push", key, dense)
        check_shape("push", key, dense[0].shape, self._shapes[name])
        if self._compress is not None and not self._kind.dist:
            dense = [self._compress((name, i), p) for i, p in enumerate(dense)]
        total = self._merge("push", key, dense)
        if self._compress is not None and self._kind.dist:
            total = self._compress(name, total)
        return total

    def _check_sparse_push(self, key: Key) -> None:
        """Row-sparse gradients are pushed dense: refused where MXNet's lazy row update would
        differ from a dense update with zero rows (momentum, weight decay, Adam)."""
        if self._compress is not None:
            raise InvalidArgumentError(
                f"push {key!r}: gradient compression is for dense values, not row_sparse ones"
            )
        opt = self._optimizer
        if opt is None:
            return
        h = opt.hparams
        lazy_equals_dense = (
            opt.name == "sgd" and h.get("momentum", 0) == 0 and h.get("weight_decay", 0) == 0
        ) or (opt.name == "adagrad" and h.get("weight_decay", 0) == 0 and h.get("lr_decay", 0) == 0)
        if not lazy_equals_dense:
            raise InvalidArgumentError(
                f"push {key!r}: a row_sparse gradient with optimizer {opt.name} {h} would update "
                "rows it does not list (MXNet's lazy update leaves them alone); push a dense "
                "gradient, or use SGD without momentum and wd, or AdaGrad without wd"
            )

    def _known(self, key: Key) -> str:
        if str(key) not in self._keys:
            raise KeyNotInitError(f"key {key!r} has not been inited: call kv.init first")
        return str(key)

    def _merge(self, what: str, key: Key, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The sum of per-device values: on the CPU for local types, on the first value's
        device for device types."""
        return merge(what, key, parts, self._on_device)

    def _fill_every_row(self, key: Key, target: RowSparse, value: torch.Tensor) -> None:
        check_shape("pull", key, torch.Size(target.shape), value.shape)
        target.indices = torch.arange(len(value))
        target.data = value.to(target.data.device, target.data.dtype)


__all__ = ["Key", "KVStore", "Updater", "Value"]
