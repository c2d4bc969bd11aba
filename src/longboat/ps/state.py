"""What one parameter server holds and how requests change it (no gRPC here: see server.py).

Dense blocks carry their value, their optimizer and a version (updates applied). A push's
effect depends on the block's ``update``: "optimizer" (a server-side optimizer step),
"sum" (the value becomes the mean gradient: trainers run the optimizer), "delta" (geo: the
value moves by the pushed delta) or "assign" (kv default: the value becomes the push). In
sync jobs a block waits for all trainers' pushes of one step, sums them in trainer order and
divides by the number of trainers before applying once (blocks with ``reduce="sum"``, as
MXNet's KVStore has them, skip the division). Sparse tables are sharded by row id
(``id % num_servers``) and updated per touched row.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from longboat.ps import optim, wire
from longboat.ps.sparse import initial_rows
from longboat.ps.wire import Message

UPDATES = ("optimizer", "sum", "delta", "assign")
REDUCES = ("mean", "sum")
SCOPES = ("engine", "kv")  # who says hello: lb.ps.distribute's engine, or a KVClient


class RequestError(ValueError):
    """A request that is well-formed on the wire but wrong for this server's state."""


class StaleStep(RuntimeError):
    """A sync push or pull for a step this server is not at (e.g. it restarted from a checkpoint)."""


@dataclass
class DenseBlock:
    value: torch.Tensor
    update: str
    sync: bool
    optimizer: str | None
    hparams: dict[str, Any]
    group: int = 0
    opt: torch.optim.Optimizer | None = None
    version: int = 0
    pending: dict[int, torch.Tensor] = field(default_factory=dict)
    reduce: str = "mean"  # how one step's pushes of all trainers combine (sync), or scale (async)
    round_lr: tuple[int, Any] | None = None  # (trainer, learning rate) of this step's first push


@dataclass
class Table:
    weight: torch.Tensor  # this server's rows: local row r is global id r * num_servers + index
    optimizer: str
    hparams: dict[str, Any]
    sync: bool
    state: dict[str, torch.Tensor]
    spec: dict[str, Any]
    version: int = 0
    pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
           "bfloat16": torch.bfloat16}  # fmt: skip


class ServerState:
    """The blocks, tables and barriers of server ``index`` of ``num_servers``."""

    def __init__(self, index: int, num_servers: int, max_table_bytes: int = 1 << 31) -> None:
        self.index, self.num_servers = index, num_servers
        self.max_table_bytes = max_table_bytes
        self.cond = threading.Condition()
        self.blocks: dict[str, DenseBlock] = {}
        self.tables: dict[str, Table] = {}
        self.trainers = 0
        self.digest = ""
        self.barriers: dict[tuple[str, int], set[int]] = {}
        self.settings: dict[str, dict[str, Any]] = {}  # scope -> {"set_by", "settings"}
        self.on_version: Callable[[int], None] | None = None  # periodic checkpoints

    # ---- hello ----------------------------------------------------------------------------
    def hello(self, msg: Message, own: dict[str, Any]) -> Message:
        """Keep the first trainer's ``settings`` of its ``scope``; reply with the kept ones,
        overlaid with this server's ``own`` (and its index, server count, trainer count): the
        trainer compares them with its own (``longboat.ps.settings``)."""
        scope, trainer = msg.meta.get("scope"), meta_int(msg.meta, "trainer", 0)
        settings = msg.meta.get("settings")
        if scope not in SCOPES or not isinstance(settings, dict):
            raise RequestError(f"hello needs 'scope' (one of {SCOPES}) and a 'settings' object")
        with self.cond:
            kept = self.settings.setdefault(scope, {"set_by": trainer, "settings": settings})
            reply = {**kept["settings"], **own}
            reply |= {"server_index": self.index, "num_servers": self.num_servers}
            if self.trainers and "trainers" in reply:
                reply["trainers"] = self.trainers
        return Message({"settings": reply, "set_by": kept["set_by"]})

    # ---- init ---------------------------------------------------------------------------
    def init(self, msg: Message) -> Message:
        """Create blocks and tables (idempotent: a restored server keeps its values). Every
        spec is checked before any is applied: a refused init changes nothing."""
        meta = msg.meta
        trainers = meta_int(meta, "trainers", 1)
        if trainers < 1:
            raise RequestError(f"'trainers' must be at least 1, got {trainers}")
        sync = bool(meta.get("sync", False))
        digest = str(meta.get("digest", ""))
        with self.cond:
            if digest and self.digest and digest != self.digest:
                raise RequestError(
                    f"server {self.index}: this trainer's sharding plan {digest} differs from "
                    f"the plan {self.digest} the servers were initialised with; every trainer "
                    "must build the same model (same parameter names and shapes)"
                )
            blocks: dict[str, DenseBlock] = {}
            for spec in meta_list(meta, "blocks"):
                key, block = self._init_block(spec, msg.tensors, sync)
                if block is not None:
                    blocks.setdefault(key, block)
            tables: dict[str, Table] = {}
            for spec in meta_list(meta, "tables"):
                name, table = self._init_table(spec, sync)
                if table is not None:
                    tables.setdefault(name, table)
            self.digest = self.digest or digest
            self.trainers = self.trainers or trainers
            self.blocks.update(blocks)
            self.tables.update(tables)
            self.cond.notify_all()
            versions = [b.version for b in self.blocks.values()]
            return Message({"version": min(versions) if versions else 0})

    def _init_block(
        self, spec: Any, tensors: dict[str, torch.Tensor], sync: bool
    ) -> tuple[str, DenseBlock | None]:
        """The block ``spec`` creates (None: it exists, or another trainer brings its value)."""
        if not isinstance(spec, dict) or not isinstance(spec.get("key"), str):
            raise RequestError("each block spec needs a string 'key'")
        key = spec["key"]
        value = tensors.get(key)
        if key in self.blocks or value is None:
            return key, None
        return key, _make_block(key, spec, value.clone(), sync)

    def configure(self, msg: Message) -> Message:
        """Change the update rule (and optimizer) of existing blocks: a fresh optimizer state,
        the value kept. Refused for a block with pushes of a half-finished sync step."""
        with self.cond:
            specs = meta_list(msg.meta, "blocks")
            for spec in specs:
                key = spec.get("key") if isinstance(spec, dict) else None
                block = self.blocks.get(key) if isinstance(key, str) else None
                if block is None:
                    raise RequestError(f"configure: server {self.index} holds no block {key!r}")
                if block.pending:
                    raise RequestError(
                        f"configure: block {key!r} has pushes of step {block.version} from "
                        f"trainers {sorted(block.pending)} waiting for the others; change the "
                        "optimizer between steps"
                    )
            new = {}
            for spec in specs:
                old = self.blocks[spec["key"]]
                new[spec["key"]] = _make_block(spec["key"], spec, old.value, old.sync)
                new[spec["key"]].version = old.version
            self.blocks.update(new)  # all or none
            self.cond.notify_all()
        return Message({"configured": len(specs)})

    def _init_table(self, spec: Any, sync: bool) -> tuple[str, Table | None]:
        """The table ``spec`` creates (None: it exists)."""
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise RequestError("each table spec needs a string 'name'")
        name = spec["name"]
        if name in self.tables:
            return name, None
        rows, dim = meta_int(spec, "rows", 0), meta_int(spec, "dim", 0)
        dtype_name = spec.get("dtype", "float32")
        dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if rows < 1 or dim < 1 or dtype is None:
            raise RequestError(f"table {name!r}: need rows >= 1, dim >= 1 and a float dtype")
        local = len(range(self.index, rows, self.num_servers))
        opt_name = spec.get("optimizer")
        if not isinstance(opt_name, str):
            raise RequestError(f"table {name!r}: 'optimizer' must be a string, got {opt_name!r}")
        states = len(optim.ROW_STATES.get(opt_name, ())) + 1
        if local * dim * dtype.itemsize * states > self.max_table_bytes:
            raise RequestError(f"table {name!r} needs more than {self.max_table_bytes} bytes here")
        seed, scale = meta_int(spec, "seed", 0), spec.get("scale", 0.01)
        if not 0 <= seed < 1 << 63:
            raise RequestError(f"table {name!r}: 'seed' must be in [0, 2**63), got {seed}")
        if not isinstance(scale, int | float) or not math.isfinite(scale):
            raise RequestError(f"table {name!r}: 'scale' must be a finite number, got {scale!r}")
        try:
            h = optim.check_hparams(opt_name, spec.get("hparams") or {})
            state = optim.row_state(opt_name, h, (local, dim), dtype)
        except (ValueError, TypeError) as exc:
            raise RequestError(f"table {name!r}: {exc}") from None
        ids = torch.arange(self.index, rows, self.num_servers)
        weight = initial_rows(ids, dim, seed, float(scale), dtype)
        return name, Table(weight, opt_name, h, sync, state, dict(spec))

    # ---- push -----------------------------------------------------------------------------
    def push(self, msg: Message, deadline: float | None = None) -> Message:
        """Apply (or, in sync jobs, collect) gradients for blocks and table rows.

        A sync trainer one step ahead (it pushed step k, the others have not yet, and it now
        pushes k + 1, as a KVStore worker pushing twice without a pull does) waits, until
        ``deadline``, for step k to complete, as MXNet's servers hold such a push.
        """
        trainer, step = meta_int(msg.meta, "trainer", 0), meta_int(msg.meta, "step", -1)
        lrs = msg.meta.get("lrs") or []
        if not isinstance(lrs, list) or not all(
            isinstance(lr, int | float) and not isinstance(lr, bool) and math.isfinite(lr)
            for lr in lrs
        ):
            raise RequestError("'lrs' must list the learning rate (a number) of each param group")
        with self.cond:
            if not 0 <= trainer < max(self.trainers, 1):
                raise RequestError(f"trainer {trainer} is out of range (job has {self.trainers})")
            dense = {k: t for k, t in msg.tensors.items() if "@" not in k}
            sparse = {k: t for k, t in msg.tensors.items() if "@" in k}
            for key, grad in dense.items():
                self._check_dense(key, grad)
            tables = self._sparse_pushes(sparse)
            if deadline is not None:
                held = [self.blocks[k] for k in dense] + [self.tables[n] for n in tables]
                self._wait(
                    lambda: not any(
                        h.sync and step == h.version + 1 and trainer in h.pending for h in held
                    ),
                    deadline,
                    f"the other trainers' pushes of step {step - 1} (trainer {trainer} pushed "
                    f"step {step})",
                )
            for key, grad in dense.items():
                block = self.blocks[key]
                lr = lrs[block.group] if block.group < len(lrs) else None
                self._push_block(key, block, grad, trainer, step, lr)
            for name, (ids, grad) in tables.items():
                self._push_table(name, ids, grad, trainer, step)
            self.cond.notify_all()
        return Message({})

    def _check_dense(self, key: str, grad: torch.Tensor) -> None:
        block = self.blocks.get(key)
        if block is None:
            raise RequestError(f"server {self.index} holds no block {key!r} (initialised?)")
        if grad.shape != block.value.shape or grad.dtype != block.value.dtype:
            raise RequestError(
                f"block {key!r}: pushed {tuple(grad.shape)} {grad.dtype}, holds "
                f"{tuple(block.value.shape)} {block.value.dtype}"
            )

    def _sparse_pushes(
        self, sparse: dict[str, torch.Tensor]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        out = {}
        for key in sparse:
            name, _, part = key.rpartition("@")
            if part not in ("ids", "grad"):
                raise RequestError(f"sparse entry {key!r} must end in @ids or @grad")
            if name not in self.tables:
                raise RequestError(f"server {self.index} holds no table {name!r}")
            if name in out:
                continue
            ids, grad = sparse.get(f"{name}@ids"), sparse.get(f"{name}@grad")
            table = self.tables[name]
            if ids is None or grad is None or ids.dtype != torch.int64 or ids.dim() != 1:
                raise RequestError(f"table {name!r}: push needs int64 {name}@ids and {name}@grad")
            if grad.shape != (len(ids), table.weight.shape[1]) or grad.dtype != table.weight.dtype:
                raise RequestError(f"table {name!r}: grad shape {tuple(grad.shape)} does not fit")
            out[name] = (self._local_rows(name, ids), grad)
        return out

    def _local_rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        table = self.tables[name]
        if ids.numel() and (
            bool((ids % self.num_servers != self.index).any())
            or int(ids.min()) < 0
            or int(ids.max()) >= table.spec["rows"]
        ):
            raise RequestError(f"table {name!r}: ids outside server {self.index}'s shard")
        return ids // self.num_servers

    def _push_block(
        self, key: str, block: DenseBlock, grad: torch.Tensor, trainer: int, step: int, lr: Any
    ) -> None:
        if not block.sync:
            if block.update == "optimizer" and block.reduce == "mean":
                grad = grad / self.trainers  # a new tensor: the wire's view is read-only
            self._apply_block(block, grad, lr)
            return
        if step != block.version:
            raise StaleStep(
                f"server {self.index} block {key!r} is at step {block.version}, "
                f"trainer {trainer} pushed step {step}"
            )
        if trainer in block.pending:
            raise RequestError(f"trainer {trainer} pushed block {key!r} twice in step {step}")
        if block.round_lr is not None and block.round_lr[1] != lr:
            first, first_lr = block.round_lr
            raise RequestError(
                f"block {key!r} step {step}: trainer {trainer} pushed with learning rate {lr}, "
                f"trainer {first} with {first_lr}; every trainer must use the same learning "
                "rate (the same optimizer settings and scheduler)"
            )
        block.round_lr = block.round_lr or (trainer, lr)
        block.pending[trainer] = grad.clone()
        if len(block.pending) == self.trainers:
            block.round_lr = None
            total = block.pending[0]
            for t in range(1, self.trainers):
                total = total + block.pending[t]
            block.pending.clear()
            self._apply_block(block, total / self.trainers if block.reduce == "mean" else total, lr)
            self._bumped(block.version)

    def _apply_block(self, block: DenseBlock, grad: torch.Tensor, lr: Any) -> None:
        with torch.no_grad():
            if block.update == "optimizer":
                assert block.opt is not None
                if lr is not None:
                    block.opt.param_groups[0]["lr"] = float(lr)
                block.value.grad = grad
                block.opt.step()
                block.value.grad = None
            elif block.update == "sum":
                block.value.copy_(grad)
            elif block.update == "delta":
                block.value.add_(grad)
            else:
                block.value.copy_(grad)
        block.version += 1

    def _push_table(
        self, name: str, rows: torch.Tensor, grad: torch.Tensor, trainer: int, step: int
    ) -> None:
        table = self.tables[name]
        if not table.sync:
            self._apply_rows(table, rows, grad, 1)
            return
        if step != table.version:
            raise StaleStep(
                f"server {self.index} table {name!r} is at step {table.version}, "
                f"trainer {trainer} pushed step {step}"
            )
        if trainer in table.pending:
            raise RequestError(f"trainer {trainer} pushed table {name!r} twice in step {step}")
        table.pending[trainer] = (rows.clone(), grad.clone())
        if len(table.pending) == self.trainers:
            parts = [table.pending[t] for t in range(self.trainers)]
            table.pending.clear()
            self._apply_rows(
                table,
                torch.cat([p[0] for p in parts]),
                torch.cat([p[1] for p in parts]),
                self.trainers,
            )
            self._bumped(table.version)

    def _apply_rows(
        self, table: Table, rows: torch.Tensor, grad: torch.Tensor, divisor: int
    ) -> None:
        unique, inverse = torch.unique(rows, return_inverse=True)
        merged = torch.zeros(len(unique), grad.shape[1], dtype=grad.dtype)
        merged.index_add_(0, inverse, grad)
        if divisor != 1:
            merged /= divisor
        table.version += 1
        if len(unique):
            optim.apply_rows(
                table.optimizer,
                table.weight,
                table.state,
                unique,
                merged,
                table.hparams,
                table.version,
            )

    def _bumped(self, version: int) -> None:
        if (
            self.on_version is not None
            and all(b.version >= version for b in self.blocks.values() if b.sync)
            and all(t.version >= version for t in self.tables.values() if t.sync)
        ):
            self.on_version(version)

    # ---- pull -----------------------------------------------------------------------------
    def pull(self, msg: Message, deadline: float) -> bytes:
        """The encoded values of the requested blocks and table rows, once they reach
        ``version`` (encoded under the lock: one copy, never a half-updated block)."""
        keys = msg.meta.get("keys") or []
        version = meta_int(msg.meta, "version", 0)
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise RequestError("'keys' must be a list of block keys")
        if any(not k.endswith("@ids") for k in msg.tensors):
            raise RequestError("a pull carries only '<table>@ids' tensors (the rows it wants)")
        id_entries = {k[: -len("@ids")]: t for k, t in msg.tensors.items()}
        with self.cond:
            for key in keys:
                if key not in self.blocks:
                    raise RequestError(f"server {self.index} holds no block {key!r}")
            for name, ids in id_entries.items():
                if name not in self.tables or ids.dtype != torch.int64 or ids.dim() != 1:
                    raise RequestError(f"pull of table {name!r}: unknown table or ids not int64")

            def ready() -> bool:
                return all(self.blocks[k].version >= version for k in keys) and all(
                    self.tables[n].version >= version for n in id_entries
                )

            self._wait(ready, deadline, f"blocks/tables reaching step {version}")
            out = {k: self.blocks[k].value for k in keys}
            for name, ids in id_entries.items():
                out[f"{name}@rows"] = self.tables[name].weight[self._local_rows(name, ids)]
            return wire.encode(Message({}, out))

    def barrier(self, msg: Message, deadline: float) -> Message:
        """Return once all trainers reached barrier ``generation`` of the barrier ``name``
        (independent counters: the engine's, kv's and fleet's barriers never mix)."""
        trainer, gen = meta_int(msg.meta, "trainer", 0), meta_int(msg.meta, "generation", 0)
        name = msg.meta.get("name", "")
        if not isinstance(name, str):
            raise RequestError("barrier 'name' must be a string")
        trainers = meta_int(msg.meta, "trainers", 0)
        if trainers < 0:
            raise RequestError(f"'trainers' must not be negative, got {trainers}")
        with self.cond:
            self.trainers = self.trainers or trainers
            if not 0 <= trainer < max(self.trainers, 1):
                raise RequestError(f"trainer {trainer} is out of range (job has {self.trainers})")
            self.barriers.setdefault((name, gen), set()).add(trainer)
            for old in [k for k in self.barriers if k[0] == name and k[1] < gen - 1]:
                del self.barriers[old]
            self.cond.notify_all()
            self._wait(
                lambda: (
                    len(self.barriers.get((name, gen), ())) >= max(self.trainers, 1)
                    or any(n == name and g > gen for n, g in self.barriers)
                ),
                deadline,
                f"all {self.trainers} trainers at barrier {name or 'step'} {gen}",
            )
        return Message({})

    def missing(self, meta: dict[str, Any]) -> list[int]:
        """The trainers this server still lacks for what a stalled call waits on: their pushes
        of the blocks ``keys`` / sync ``tables`` below ``version``, or their arrival at
        ``barrier`` = [name, generation]."""
        with self.cond:
            everyone = set(range(self.trainers))
            barrier = meta.get("barrier")
            if barrier is not None:
                if not (isinstance(barrier, list) and len(barrier) == 2):
                    raise RequestError("'barrier' must be [name, generation]")
                name, gen = str(barrier[0]), meta_int({"g": barrier[1]}, "g", 0)
                if any(n == name and g > gen for n, g in self.barriers):
                    return []  # that barrier is over
                return sorted(everyone - self.barriers.get((name, gen), set()))
            version = meta_int(meta, "version", 0)
            lacking: set[int] = set()
            for key in meta_list(meta, "keys"):
                block = self.blocks.get(key) if isinstance(key, str) else None
                if block is not None and block.sync and block.version < version:
                    lacking |= everyone - set(block.pending)
            for name in meta_list(meta, "tables"):
                table = self.tables.get(name) if isinstance(name, str) else None
                if table is not None and table.sync and table.version < version:
                    lacking |= everyone - set(table.pending)
            return sorted(lacking)

    def _wait(self, ready: Callable[[], bool], deadline: float, what: str) -> None:
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"server {self.index} waited for {what} until the deadline; "
                    "is another trainer stuck or dead?"
                )
            self.cond.wait(min(left, 1.0))

    # ---- checkpoint state -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a restarted server needs (tensors, numbers, strings: weights_only-safe)."""
        with self.cond:
            blocks = {}
            for key, b in self.blocks.items():
                blocks[key] = {
                    "value": b.value.detach().clone(),
                    "version": b.version,
                    "config": json.dumps(
                        {
                            "group": b.group,
                            "update": b.update,
                            "sync": b.sync,
                            "optimizer": b.optimizer,
                            "hparams": b.hparams,
                            "reduce": b.reduce,
                        }
                    ),
                    "opt": b.opt.state_dict() if b.opt is not None else {},
                }
            tables = {
                name: {
                    "weight": t.weight.clone(),
                    "version": t.version,
                    "spec": json.dumps(t.spec),
                    "sync": t.sync,
                    "state": {k: v.clone() for k, v in t.state.items()},
                }
                for name, t in self.tables.items()
            }
            return {
                "index": self.index,
                "num_servers": self.num_servers,
                "trainers": self.trainers,
                "digest": self.digest,
                "settings": json.dumps(self.settings),
                "blocks": blocks,
                "tables": tables,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace this server's contents with a ``state_dict`` (from the same server index)."""
        if state["index"] != self.index or state["num_servers"] != self.num_servers:
            raise RequestError(
                f"checkpoint is of server {state['index']} of {state['num_servers']}, this is "
                f"server {self.index} of {self.num_servers}"
            )
        with self.cond:
            self.blocks.clear()
            self.tables.clear()
            self.trainers, self.digest = int(state["trainers"]), str(state["digest"])
            self.settings = json.loads(state.get("settings", "{}"))
            for key, saved in state["blocks"].items():
                cfg = json.loads(saved["config"])
                block = DenseBlock(
                    saved["value"].clone(),
                    cfg["update"],
                    cfg["sync"],
                    cfg["optimizer"],
                    cfg["hparams"],
                    cfg["group"],
                    version=int(saved["version"]),
                    reduce=cfg.get("reduce", "mean"),
                )
                if cfg["optimizer"] is not None:
                    block.opt = optim.make_dense(cfg["optimizer"], [block.value], cfg["hparams"])
                    block.opt.load_state_dict(saved["opt"])
                self.blocks[key] = block
            for name, saved in state["tables"].items():
                spec = json.loads(saved["spec"])
                h = optim.check_hparams(spec["optimizer"], spec.get("hparams") or {})
                self.tables[name] = Table(
                    saved["weight"].clone(),
                    spec["optimizer"],
                    h,
                    bool(saved["sync"]),
                    {k: v.clone() for k, v in saved["state"].items()},
                    spec,
                    version=int(saved["version"]),
                )
            self.barriers.clear()
            self.cond.notify_all()

    def version(self) -> int:
        """The lowest version over sync blocks and tables (the step this server is at)."""
        with self.cond:
            vs = [b.version for b in self.blocks.values() if b.sync]
            vs += [t.version for t in self.tables.values() if t.sync]
            return min(vs) if vs else 0


def _make_block(key: str, spec: dict[str, Any], value: torch.Tensor, sync: bool) -> DenseBlock:
    """A block holding ``value`` configured by ``spec`` (update, optimizer, hparams, ...)."""
    update = spec.get("update", "optimizer")
    if update not in UPDATES:
        raise RequestError(f"block {key!r}: update must be one of {UPDATES}, got {update!r}")
    reduce = spec.get("reduce", "mean")
    if reduce not in REDUCES:
        raise RequestError(f"block {key!r}: reduce must be one of {REDUCES}, got {reduce!r}")
    name = spec.get("optimizer") if update == "optimizer" else None
    if update == "optimizer" and not (isinstance(name, str) and value.is_floating_point()):
        raise RequestError(
            f"block {key!r}: update 'optimizer' needs an optimizer name and a floating-point "
            f"value, got {name!r} and {value.dtype}"
        )
    hparams = spec.get("hparams") or {}
    if not isinstance(hparams, dict):
        raise RequestError(f"block {key!r}: hparams must be an object")
    group = meta_int(spec, "group", 0)
    if group < 0:
        raise RequestError(f"block {key!r}: 'group' must be >= 0, got {group}")
    block = DenseBlock(value, update, sync, name, hparams, group, reduce=reduce)
    if name is not None:
        try:
            block.opt = optim.make_dense(name, [block.value], hparams)
        except (ValueError, TypeError, IndexError, KeyError) as exc:  # torch's own checks too
            raise RequestError(f"block {key!r}: {type(exc).__name__}: {exc}") from None
    return block


def meta_int(meta: dict[str, Any], key: str, default: int) -> int:
    value = meta.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestError(f"{key!r} must be an integer, got {value!r}")
    return value


def meta_list(meta: dict[str, Any], key: str) -> list[Any]:
    value = meta.get(key) or []
    if not isinstance(value, list):
        raise RequestError(f"{key!r} must be a list")
    return value
