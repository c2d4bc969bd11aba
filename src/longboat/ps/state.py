"""What one parameter server holds and how requests change it (no gRPC here: see server.py).

Dense blocks (``blocks.py``) carry their value, their optimizer and a version. In sync jobs a
block waits for all trainers' pushes of one step, sums them in trainer order and divides by the
number of trainers that pushed before applying once (blocks with ``reduce="sum"``, as MXNet's
KVStore has them, skip the division). Sparse tables (``tables.py``) are sharded by row id
(``id % num_servers``) and updated per touched row. Request fields are read with
``request.py``.

Trainer liveness (sync steps and barriers): a trainer that something waits for and that has been
silent (no call in progress, none ended) for ``trainer_timeout`` seconds is dropped by
``drop_silent``: its pushes of unfinished steps are discarded, those steps complete with the
trainers that pushed (the mean over them) and later steps and barriers stop waiting for it. Its
pushes are refused (``Dropped``) until it calls ``join``, which makes the servers expect it again
from the step it names (the engine does so at connect, and after a refusal).
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from longboat.log import get_logger
from longboat.ps import wire
from longboat.ps.blocks import (
    REDUCES,
    UPDATES,
    DenseBlock,
    apply_block,
    block_state,
    load_block,
    make_block,
)
from longboat.ps.limits import TRAINER_TIMEOUT_ENV
from longboat.ps.request import DROPPED, Dropped, RequestError, StaleStep, meta_int, meta_list
from longboat.ps.tables import (
    Table,
    apply_rows,
    load_table,
    local_rows,
    make_table,
    read_rows,
    table_state,
)
from longboat.ps.wire import Message

SCOPES = ("engine", "kv")  # who says hello: lb.ps.distribute's engine, or a KVClient
GONE = math.inf  # ServerState.back_at of a dropped trainer that has not rejoined

log = get_logger("longboat.ps")

__all__ = ["REDUCES", "SCOPES", "UPDATES", "DenseBlock", "RequestError", "ServerState",
           "StaleStep", "Table", "meta_int", "meta_list"]  # fmt: skip


class ServerState:
    """The blocks, tables and barriers of server ``index`` of ``num_servers``; trainers silent
    for ``trainer_timeout`` seconds (read on ``clock``) may be dropped (``drop_silent``)."""

    def __init__(
        self,
        index: int,
        num_servers: int,
        max_table_bytes: int = 1 << 31,
        trainer_timeout: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
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
        # trainer liveness (see the module's docstring)
        self.trainer_timeout, self.clock = trainer_timeout, clock
        self.last_seen: dict[int, float] = {}  # trainer -> when a call of it started or ended
        self.busy: dict[int, int] = {}  # trainer -> its calls in progress
        self.last_step: dict[int, int] = {}  # trainer -> the highest sync step it pushed
        self.back_at: dict[int, float] = {}  # trainer -> first step it is expected at (GONE)
        self.dropped_at: dict[int, int] = {}  # trainer -> the step that was waiting when dropped
        self.joined: set[int] = set()  # trainers that called join
        self.barrier_done: dict[str, int] = {}  # name -> the highest generation completed
        self.rollbacks = 0  # rollbacks begun (restore): sync pulls waiting then are refused
        self._refusals: set[tuple[int, int]] = set()  # (trainer, step) refusals logged

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
            self._touch(meta.get("trainer"))
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
        return key, make_block(key, spec, value.clone(), sync)

    def configure(self, msg: Message) -> Message:
        """Change the update rule (and optimizer) of existing blocks: a fresh optimizer state,
        the value kept. Refused for a block with pushes of a half-finished sync step."""
        if "shrink" in msg.meta:
            return Message({"dropped": self.shrink(msg.meta["shrink"])})
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
                new[spec["key"]] = make_block(spec["key"], spec, old.value, old.sync)
                new[spec["key"]].version = old.version
            self.blocks.update(new)  # all or none
            self.cond.notify_all()
        return Message({"configured": len(specs)})

    # ---- lazy tables ----------------------------------------------------------------------
    def shrink(self, names: Any) -> dict[str, int]:
        """End a pass of the lazy tables ``names`` (None: all of them): each drops its rows
        unseen for its ``evict_after`` passes; rows dropped per table (``configure`` with
        ``shrink`` carries this call)."""
        with self.cond:
            if names is True or names is None:
                names = [n for n, t in self.tables.items() if t.lazy is not None]
            if not isinstance(names, list) or not all(
                isinstance(n, str) and n in self.tables and self.tables[n].lazy is not None
                for n in names
            ):
                raise RequestError(f"shrink: server {self.index} has no lazy table in {names!r}")
            dropped = {n: self.tables[n].lazy.shrink() for n in names}  # type: ignore[union-attr]
            for n, k in dropped.items():
                stats = self.tables[n].lazy.stats()  # type: ignore[union-attr]
                log.info(
                    "server %d table %r: pass ended, %d rows dropped, %d kept",
                    self.index, n, k, stats["rows"],
                )  # fmt: skip
            return dropped

    def table_stats(self) -> dict[str, dict[str, Any]]:
        """Rows and bytes per row of every table (``ping`` with ``table_stats`` returns it)."""
        with self.cond:
            out = {}
            for name, t in self.tables.items():
                if t.lazy is not None:
                    out[name] = t.lazy.stats()
                else:
                    total = t.weight.nbytes + sum(v.nbytes for v in t.state.values())
                    rows = max(len(t.weight), 1)
                    out[name] = {
                        "rows": len(t.weight),
                        "bytes": total,
                        "bytes_per_row": total / rows,
                        "float32_row_bytes": 4 * t.dim,
                        "storage": str(t.dtype).removeprefix("torch."),
                    }
            return out

    def _init_table(self, spec: Any, sync: bool) -> tuple[str, Table | None]:
        """The table ``spec`` creates (None: it exists)."""
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise RequestError("each table spec needs a string 'name'")
        name = spec["name"]
        if name in self.tables:
            return name, None
        return name, make_table(
            name, spec, sync, self.index, self.num_servers, self.max_table_bytes
        )

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
        with self.cond, self._calling(trainer):
            if not 0 <= trainer < max(self.trainers, 1):
                raise RequestError(f"trainer {trainer} is out of range (job has {self.trainers})")
            dense = {k: t for k, t in msg.tensors.items() if "@" not in k}
            sparse = {k: t for k, t in msg.tensors.items() if "@" in k}
            for key, grad in dense.items():
                self._check_dense(key, grad)
            tables = self._sparse_pushes(sparse)
            synced = any(self.blocks[k].sync for k in dense)
            synced |= any(self.tables[n].sync for n in tables)
            if synced:
                self._refuse_if_dropped(trainer, step)
            if deadline is not None:
                held = [self.blocks[k] for k in dense] + [self.tables[n] for n in tables]
                self._wait(
                    lambda: (
                        not any(
                            h.sync and step == h.version + 1 and trainer in h.pending for h in held
                        )
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
            if synced:  # accepted: a pull of the next step may wait for the others
                self.last_step[trainer] = max(step, self.last_step.get(trainer, step))
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
        return local_rows(name, self.tables[name], ids, self.index, self.num_servers)

    def _push_block(
        self, key: str, block: DenseBlock, grad: torch.Tensor, trainer: int, step: int, lr: Any
    ) -> None:
        if not block.sync:
            if block.update == "optimizer" and block.reduce == "mean":
                grad = grad / self.trainers  # a new tensor: the wire's view is read-only
            apply_block(block, grad, lr)
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
        self._settle_block(block)

    def _settle_block(self, block: DenseBlock) -> None:
        """Apply ``block``'s step once every trainer expected at it pushed: their pushes summed
        in trainer order (divided by their number for ``reduce="mean"``)."""
        if not block.pending or not self._expected(block.version) <= block.pending.keys():
            return
        lr = block.round_lr[1] if block.round_lr is not None else None
        order = sorted(block.pending)
        total = block.pending[order[0]]
        for t in order[1:]:
            total = total + block.pending[t]
        block.pending.clear()
        block.round_lr = None
        apply_block(block, total / len(order) if block.reduce == "mean" else total, lr)
        self._bumped(block.version)

    def _push_table(
        self, name: str, rows: torch.Tensor, grad: torch.Tensor, trainer: int, step: int
    ) -> None:
        table = self.tables[name]
        if not table.sync:
            apply_rows(table, rows, grad, 1)
            return
        if step != table.version:
            raise StaleStep(
                f"server {self.index} table {name!r} is at step {table.version}, "
                f"trainer {trainer} pushed step {step}"
            )
        if trainer in table.pending:
            raise RequestError(f"trainer {trainer} pushed table {name!r} twice in step {step}")
        table.pending[trainer] = (rows.clone(), grad.clone())
        self._settle_table(table)

    def _settle_table(self, table: Table) -> None:
        """Apply ``table``'s step once every trainer expected at it pushed (the mean over them)."""
        if not table.pending or not self._expected(table.version) <= table.pending.keys():
            return
        parts = [table.pending[t] for t in sorted(table.pending)]
        table.pending.clear()
        apply_rows(
            table,
            torch.cat([p[0] for p in parts]),
            torch.cat([p[1] for p in parts]),
            len(parts),
        )
        self._bumped(table.version)

    def _bumped(self, version: int) -> None:
        if (
            self.on_version is not None
            and all(b.version >= version for b in self.blocks.values() if b.sync)
            and all(t.version >= version for t in self.tables.values() if t.sync)
        ):
            self.on_version(version)

    # ---- pull -----------------------------------------------------------------------------
    def pull(self, msg: Message, deadline: float) -> bytes:
        """The encoded values of the requested blocks and rows, once they reach ``version``
        (encoded under the lock: one copy, never a half-updated block). ``<name>@ids`` asks
        for rows: of table ``name`` by global id, else of block ``name`` by row of its value
        (sorted, unique: the reply is never larger than the block); they come back as
        ``<name>@rows``."""
        keys = msg.meta.get("keys") or []
        version = meta_int(msg.meta, "version", 0)
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise RequestError("'keys' must be a list of block keys")
        if any(not k.endswith("@ids") for k in msg.tensors):
            raise RequestError(
                "a pull carries only '<table>@ids' tensors (the rows it wants; a block's "
                "rows as '<block>@ids')"
            )
        id_entries = {k[: -len("@ids")]: t for k, t in msg.tensors.items()}
        trainer = msg.meta.get("trainer")
        with self.cond, self._calling(trainer if isinstance(trainer, int) else None):
            for key in keys:
                if key not in self.blocks:
                    raise RequestError(f"server {self.index} holds no block {key!r}")
            for name, ids in id_entries.items():
                if ids.dtype != torch.int64 or ids.dim() != 1:
                    raise RequestError(f"pull of rows of {name!r}: ids must be 1-D int64")
                if name not in self.tables:
                    self._check_block_rows(name, ids)

            holders = [self.blocks[k] for k in keys]
            holders += [self.tables[n] if n in self.tables else self.blocks[n] for n in id_entries]
            rollbacks = self.rollbacks

            def ready() -> bool:
                behind = [h for h in holders if h.version < version]
                if behind:
                    self._refuse_lost_pull(trainer, version, behind, rollbacks)
                return not behind

            self._wait(ready, deadline, f"blocks/tables reaching step {version}")
            out = {k: self.blocks[k].value for k in keys}
            for name, ids in id_entries.items():
                out[f"{name}@rows"] = (
                    read_rows(self.tables[name], self._local_rows(name, ids))
                    if name in self.tables
                    else self.blocks[name].value.index_select(0, ids)
                )
            return wire.encode(Message({}, out))

    def _check_block_rows(self, key: str, ids: torch.Tensor) -> None:
        """Refuse a row pull of block ``key`` unless ``ids`` are sorted, unique rows of it."""
        block = self.blocks.get(key)
        if block is None:
            raise RequestError(f"server {self.index} holds no table or block {key!r}")
        if block.value.dim() == 0:
            raise RequestError(f"row pull of block {key!r}: a 0-d value has no rows")
        rows = len(block.value)
        if len(ids) and (
            int(ids[0]) < 0 or int(ids[-1]) >= rows or not bool((ids[1:] > ids[:-1]).all())
        ):
            raise RequestError(
                f"row pull of block {key!r}: ids must be sorted, unique and in [0, {rows})"
            )

    def _refuse_lost_pull(
        self, trainer: Any, version: int, behind: list[DenseBlock | Table], rollbacks: int
    ) -> None:
        """Raise ``StaleStep`` for a pull of sync ``version`` that nothing will answer: the
        servers began rolling back since it arrived, or ``trainer`` never pushed the step
        before ``version`` here and did not join at ``version`` (this server restarted from an
        older checkpoint and lost that push). A pull waiting for the other trainers' pushes of
        a step it pushed, or for the step it joined at, is not refused."""
        if not any(h.sync for h in behind):
            return
        if self.rollbacks != rollbacks:
            raise StaleStep(
                f"server {self.index}: a pull of step {version} was waiting when the servers "
                "began rolling back to a checkpoint (restore): pull again after it"
            )
        if (
            isinstance(trainer, int)
            and self.last_step.get(trainer, -1) < version - 1
            and self.back_at.get(trainer, 0) < version
        ):
            at = min(h.version for h in behind)
            raise StaleStep(
                f"server {self.index} is at step {at} (restarted from its checkpoint, or rolled "
                f"back) and never received trainer {trainer}'s push of step {version - 1}: its "
                f"pull of step {version} cannot be answered; roll the servers back "
                "(PSEngine.restore) and push the steps since again"
            )

    def begin_rollback(self) -> None:
        """A rollback (restore) begins: refuse the sync pulls waiting now."""
        with self.cond:
            self.rollbacks += 1
            self.cond.notify_all()

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
            with self._calling(trainer):
                self.barriers.setdefault((name, gen), set()).add(trainer)
                for old in [k for k in self.barriers if k[0] == name and k[1] < gen - 1]:
                    del self.barriers[old]
                self.cond.notify_all()
                self._wait(
                    lambda: self._barrier_over(name, gen),
                    deadline,
                    f"all {self.trainers} trainers at barrier {name or 'step'} {gen}",
                )
                self.barrier_done[name] = max(gen, self.barrier_done.get(name, 0))
        return Message({})

    def _barrier_over(self, name: str, gen: int) -> bool:
        """Barrier ``gen`` completed, every trainer still in the job reached it, or one is
        past it."""
        return (
            gen <= self.barrier_done.get(name, 0)
            or self.present() <= self.barriers.get((name, gen), set())
            or any(n == name and g > gen for n, g in self.barriers)
        )

    def missing(self, meta: dict[str, Any]) -> list[int]:
        """The trainers this server still lacks for what a stalled call waits on: their pushes
        of the blocks ``keys`` / sync ``tables`` below ``version``, or their arrival at
        ``barrier`` = [name, generation]."""
        with self.cond:
            barrier = meta.get("barrier")
            if barrier is not None:
                if not (isinstance(barrier, list) and len(barrier) == 2):
                    raise RequestError("'barrier' must be [name, generation]")
                name, gen = str(barrier[0]), meta_int({"g": barrier[1]}, "g", 0)
                if self._barrier_over(name, gen):
                    return []
                everyone = self.present() & set(range(self.trainers))
                return sorted(everyone - self.barriers.get((name, gen), set()))
            version = meta_int(meta, "version", 0)
            lacking: set[int] = set()
            for key in meta_list(meta, "keys"):
                block = self.blocks.get(key) if isinstance(key, str) else None
                if block is not None and block.sync and block.version < version:
                    lacking |= self._expected(block.version) - set(block.pending)
            for name in meta_list(meta, "tables"):
                table = self.tables.get(name) if isinstance(name, str) else None
                if table is not None and table.sync and table.version < version:
                    lacking |= self._expected(table.version) - set(table.pending)
            return sorted(lacking)

    # ---- trainer liveness -------------------------------------------------------------------
    def present(self) -> set[int]:
        """The trainers barriers wait for: all but those dropped and not rejoined."""
        return {t for t in range(max(self.trainers, 1)) if self.back_at.get(t, 0) != GONE}

    def _expected(self, step: int) -> set[int]:
        """The trainers whose pushes sync step ``step`` waits for."""
        return {t for t in range(self.trainers) if self.back_at.get(t, 0) <= step}

    def _touch(self, trainer: Any) -> None:
        """A sign of life of ``trainer`` (ignored unless a trainer index of this job)."""
        if isinstance(trainer, int) and 0 <= trainer < self.trainers:
            self.last_seen[trainer] = self.clock()

    @contextlib.contextmanager
    def _calling(self, trainer: int | None) -> Iterator[None]:
        """``trainer`` has a call in progress (under the lock; it is not silent meanwhile)."""
        if trainer is None or not 0 <= trainer < self.trainers:
            yield
            return
        self._touch(trainer)
        self.busy[trainer] = self.busy.get(trainer, 0) + 1
        try:
            yield
        finally:
            self.busy[trainer] -= 1
            self._touch(trainer)

    def _refuse_if_dropped(self, trainer: int, step: int) -> None:
        """Raise ``Dropped`` for a sync push of ``step`` the servers no longer expect from
        ``trainer`` (dropped, and not rejoined for that step)."""
        back = self.back_at.get(trainer, 0)
        if back <= step:
            return
        state = "has not rejoined" if back == GONE else f"rejoined from step {int(back)}"
        text = (
            f"server {self.index}: trainer {trainer}'s push of step {step} is refused (not "
            f"applied): the trainer {DROPPED} at step {self.dropped_at.get(trainer, step)} "
            f"after {TRAINER_TIMEOUT_ENV}={self.trainer_timeout:g} s of silence and {state}"
        )
        if (trainer, step) not in self._refusals:
            self._refusals.add((trainer, step))
            log.warning("%s", text)
        raise Dropped(f"{text}; its engine rejoins by itself (PSEngine.rejoin)")

    def _lacking(self) -> dict[int, str]:
        """The trainers something waits for (a sync step with pushes of others, a barrier with
        arrivals), each with the first such thing."""
        out: dict[int, str] = {}
        expected: dict[int, set[int]] = {}  # per step
        holders: list[DenseBlock | Table] = [*self.blocks.values(), *self.tables.values()]
        for h in holders:
            if h.sync and h.pending:
                if h.version not in expected:
                    expected[h.version] = self._expected(h.version)
                for t in sorted(expected[h.version] - h.pending.keys()):
                    out.setdefault(t, f"step {h.version}")
        for (name, gen), arrived in sorted(self.barriers.items()):
            if arrived and not self._barrier_over(name, gen):
                for t in sorted(self.present() - arrived):
                    out.setdefault(t, f"barrier {name or 'step'} {gen}")
        return out

    def drop_silent(self) -> list[int]:
        """Drop every trainer something waits for that has been silent (no call in progress,
        none ended) for ``trainer_timeout`` seconds; the trainers dropped (the server calls
        this every fraction of the timeout)."""
        with self.cond:
            now, dropped = self.clock(), []
            for t, what in self._lacking().items():
                seen = self.last_seen.get(t)
                if seen is None or self.busy.get(t) or now - seen < self.trainer_timeout:
                    continue  # never seen (still starting), in a call, or not silent long enough
                self.back_at[t] = GONE
                self.dropped_at[t] = self.version()
                discarded = self._discard(t)
                dropped.append(t)
                last = self.last_step.get(t)
                log.warning(
                    "server %d: dropped trainer %d: silent for %.1f s (longer than %s=%g s) "
                    "while %s waited for it; its last step: %s%s. The sync steps and barriers "
                    "go on with trainers %s until it rejoins",
                    self.index,
                    t,
                    now - seen,
                    TRAINER_TIMEOUT_ENV,
                    self.trainer_timeout,
                    what,
                    "none" if last is None else last,
                    f" ({discarded} pushes of unfinished steps discarded)" if discarded else "",
                    sorted(self.present()),
                )
            if dropped:
                self._settle()
            return dropped

    def _discard(self, trainer: int) -> int:
        """Forget ``trainer``'s pushes of unfinished sync steps; how many there were."""
        n = 0
        for block in self.blocks.values():
            if block.pending.pop(trainer, None) is not None:
                n += 1
                if not block.pending:
                    block.round_lr = None
                elif block.round_lr is not None and block.round_lr[0] == trainer:
                    block.round_lr = (min(block.pending), block.round_lr[1])
        for table in self.tables.values():
            n += table.pending.pop(trainer, None) is not None
        return n

    def _settle(self) -> None:
        """Complete the steps every expected trainer has pushed; wake the waiting calls."""
        for block in self.blocks.values():
            if block.sync:
                self._settle_block(block)
        for table in self.tables.values():
            if table.sync:
                self._settle_table(table)
        self.cond.notify_all()

    def join(self, msg: Message) -> Message:
        """Trainer ``trainer`` (again) takes part from sync step ``step`` on, or from the
        latest step this server has begun if that is later (the reply's ``step``: the trainer
        asks again with the highest reply). Its pushes of unfinished steps (from an earlier
        process) are discarded. ``rejoined``: it had joined before; ``barrier``: the latest
        completed generation of the engine's barrier."""
        trainer, step = meta_int(msg.meta, "trainer", 0), meta_int(msg.meta, "step", 0)
        with self.cond:
            if not 0 <= trainer < self.trainers:
                raise RequestError(f"join: trainer {trainer} is out of range ({self.trainers})")
            again = trainer in self.joined or trainer in self.back_at
            versions = [b.version for b in self.blocks.values() if b.sync]
            versions += [t.version for t in self.tables.values() if t.sync]
            start = max([step, *versions])
            discarded = self._discard(trainer)
            self.back_at[trainer] = start
            self.joined.add(trainer)
            self._touch(trainer)
            self._settle()
            if again:
                log.info(
                    "server %d: trainer %d rejoins; expected again from step %d%s",
                    self.index,
                    trainer,
                    start,
                    f" ({discarded} pushes of an earlier process discarded)" if discarded else "",
                )
            return Message(
                {"step": start, "rejoined": again, "barrier": self.barrier_done.get("", 0)}
            )

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
    def state_dict(self, rows_file: Callable[[int], Any] | None = None) -> dict[str, Any]:
        """Everything a restarted server needs (tensors, numbers, strings: weights_only-safe);
        ``rows_file(k)``: where the k-th lazy table streams its rows (default: in the dict)."""
        with self.cond:
            blocks = {key: block_state(b) for key, b in self.blocks.items()}
            tables, lazy = {}, 0
            for name, t in self.tables.items():
                path = None
                if t.lazy is not None and rows_file is not None:
                    path, lazy = rows_file(lazy), lazy + 1
                tables[name] = table_state(t, path)
            return {
                "index": self.index,
                "num_servers": self.num_servers,
                "trainers": self.trainers,
                "digest": self.digest,
                "settings": json.dumps(self.settings),
                "blocks": blocks,
                "tables": tables,
            }

    def load_state_dict(self, state: dict[str, Any], directory: str | Path | None = None) -> None:
        """Replace this server's contents with a ``state_dict`` (from the same server index);
        ``directory``: the checkpoint's, where its lazy tables' row files lie."""
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
            self.blocks.update({k: load_block(s) for k, s in state["blocks"].items()})
            self.tables.update(
                {
                    n: load_table(s, directory, self.max_table_bytes)
                    for n, s in state["tables"].items()
                }
            )
            self.barriers.clear()
            self.back_at.clear()  # a rolled-back job waits for every trainer again
            self.last_step.clear()  # no trainer has pushed a step since the checkpoint
            self.barrier_done.clear()
            self.cond.notify_all()

    def version(self) -> int:
        """The lowest version over sync blocks and tables (the step this server is at)."""
        with self.cond:
            vs = [b.version for b in self.blocks.values() if b.sync]
            vs += [t.version for t in self.tables.values() if t.sync]
            return min(vs) if vs else 0
