"""What one parameter server holds and how requests change it (no gRPC here: see server.py).

Dense blocks (``blocks.py``) carry their value, their optimizer and a version. In sync jobs a
block waits for all trainers' pushes of one step, sums them in trainer order and divides by the
number of trainers that pushed before applying once (blocks with ``reduce="sum"``, as MXNet's
KVStore has them, skip the division). Sparse tables (``tables.py``) are sharded by row id
(``id % num_servers``) and updated per touched row. Each method takes its request parsed by
``schema.py`` (or a ``Message`` it parses) and checks it against what the server holds before
changing anything: a refused request leaves the state as it was.

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
from longboat.ps import schema, wire
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
from longboat.ps.request import DROPPED, Closing, Dropped, RequestError, StaleStep
from longboat.ps.schema import SCOPES
from longboat.ps.tables import Table, apply_rows, load_table, make_table, read_rows, table_state
from longboat.ps.wire import Message

GONE = math.inf  # ServerState.back_at of a dropped trainer that has not rejoined

log = get_logger("longboat.ps")

__all__ = ["REDUCES", "SCOPES", "UPDATES", "DenseBlock", "RequestError", "ServerState",
           "StaleStep", "Table"]  # fmt: skip


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
        self.closed = False  # the server is stopping: every wait ends (``close``)
        self._refusals: set[tuple[int, int]] = set()  # (trainer, step) refusals logged

    # ---- hello ----------------------------------------------------------------------------
    def hello(self, msg: Message | schema.Hello, own: dict[str, Any]) -> Message:
        """Keep the first trainer's ``settings`` of its ``scope``; reply with the kept ones,
        overlaid with this server's ``own`` (and its index, server count, trainer count): the
        trainer compares them with its own (``longboat.ps.settings``)."""
        req = schema.Hello.of(msg)
        with self.cond:
            req.check(self)
            kept = self.settings.setdefault(
                req.scope, {"set_by": req.trainer, "settings": req.settings}
            )
            reply = {**kept["settings"], **own}
            reply |= {"server_index": self.index, "num_servers": self.num_servers}
            if self.trainers and "trainers" in reply:
                reply["trainers"] = self.trainers
        return Message({"settings": reply, "set_by": kept["set_by"]})

    # ---- init ---------------------------------------------------------------------------
    def init(self, msg: Message | schema.Init) -> Message:
        """Create blocks and tables (idempotent: a restored server keeps its values). Every
        spec is checked before any is applied: a refused init changes nothing."""
        req = schema.Init.of(msg)
        with self.cond:
            req.check(self)
            blocks: dict[str, DenseBlock] = {}
            for spec in req.blocks:  # a block without a value: it exists, or comes later
                key, value = spec["key"], req.values.get(spec["key"])
                if key not in self.blocks and value is not None:
                    blocks[key] = make_block(key, spec, value.clone(), req.sync)
            tables: dict[str, Table] = {}
            for spec in req.tables:
                name = spec["name"]
                if name not in self.tables:
                    tables[name] = make_table(
                        name, spec, req.sync, self.index, self.num_servers, self.max_table_bytes
                    )
            self.digest = self.digest or req.digest
            self.trainers = self.trainers or req.trainers
            self._touch(req.trainer)
            self.blocks.update(blocks)
            self.tables.update(tables)
            self.cond.notify_all()
            versions = [b.version for b in self.blocks.values()]
            return Message({"version": min(versions) if versions else 0})

    def configure(self, msg: Message | schema.Configure) -> Message:
        """Change the update rule (and optimizer) of existing blocks: a fresh optimizer state,
        the value kept. Refused for a block with pushes of a half-finished sync step. With
        ``shrink``: end a pass of lazy tables (``shrink``)."""
        req = schema.Configure.of(msg)
        if req.shrink is not None or req.all_lazy:
            return Message({"dropped": self.shrink(req.shrink)})
        with self.cond:
            req.check(self)
            new = {}
            for spec in req.blocks:
                old = self.blocks[spec["key"]]
                new[spec["key"]] = make_block(spec["key"], spec, old.value, old.sync)
                new[spec["key"]].version = old.version
            self.blocks.update(new)  # all or none
            self.cond.notify_all()
        return Message({"configured": len(req.blocks)})

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

    # ---- push -----------------------------------------------------------------------------
    def push(self, msg: Message | schema.Push, deadline: float | None = None) -> Message:
        """Apply (or, in sync jobs, collect) gradients for blocks and table rows: all of them,
        or (refused) none.

        A sync trainer one step ahead (it pushed step k, the others have not yet, and it now
        pushes k + 1, as a KVStore worker pushing twice without a pull does) waits, until
        ``deadline``, for step k to complete, as MXNet's servers hold such a push.
        """
        req = schema.Push.of(msg)
        trainer, step = req.trainer, req.step
        with self.cond:
            rows = req.check(self)
            held = [self.blocks[k] for k in req.dense] + [self.tables[n] for n in req.sparse]
            synced = any(h.sync for h in held)
            if synced:
                self._refuse_if_dropped(trainer, step)
            self._check_round(req, waits=True)
            with self._calling(trainer):
                if deadline is not None:
                    self._wait(
                        lambda: (
                            not any(
                                h.sync and step == h.version + 1 and trainer in h.pending
                                for h in held
                            )
                        ),
                        deadline,
                        f"the other trainers' pushes of step {step - 1} (trainer {trainer} "
                        f"pushed step {step})",
                    )
                self._check_round(req, waits=False)
                for key, grad in req.dense.items():
                    self._push_block(self.blocks[key], grad, req)
                for name, (_, grad) in req.sparse.items():
                    self._push_table(name, rows[name], grad, trainer)
                if synced:  # accepted: a pull of the next step may wait for the others
                    self.last_step[trainer] = max(step, self.last_step.get(trainer, step))
                self.cond.notify_all()
        return Message({})

    @staticmethod
    def _lr(block: DenseBlock, req: schema.Push) -> float | None:
        """The learning rate a push gives ``block`` (None: the block's own)."""
        return req.lrs[block.group] if block.group < len(req.lrs) else None

    def _check_round(self, req: schema.Push, waits: bool) -> None:
        """Refuse a sync push that does not fit the step its blocks and tables are at:
        another step (StaleStep), a second push of the trainer, another learning rate than
        the step's first push. ``waits``: pass over pushes that wait for the step before."""
        trainer, step = req.trainer, req.step
        held: list[tuple[str, str, DenseBlock | Table]] = [
            *(("block", k, self.blocks[k]) for k in req.dense),
            *(("table", n, self.tables[n]) for n in req.sparse),
        ]
        for kind, name, h in held:
            if not h.sync or (waits and step == h.version + 1 and trainer in h.pending):
                continue
            if step != h.version:
                raise StaleStep(
                    f"server {self.index} {kind} {name!r} is at step {h.version}, "
                    f"trainer {trainer} pushed step {step}"
                )
            if trainer in h.pending:
                raise RequestError(f"trainer {trainer} pushed {kind} {name!r} twice in step {step}")
            if isinstance(h, DenseBlock) and h.round_lr is not None:
                lr = self._lr(h, req)
                if h.round_lr[1] != lr:
                    first, first_lr = h.round_lr
                    raise RequestError(
                        f"block {name!r} step {step}: trainer {trainer} pushed with learning "
                        f"rate {lr}, trainer {first} with {first_lr} ('lrs'); every trainer "
                        "must use the same learning rate (the same optimizer settings and "
                        "scheduler)"
                    )

    def _push_block(self, block: DenseBlock, grad: torch.Tensor, req: schema.Push) -> None:
        """Apply (async) or collect (sync) one block's push (``_check_round`` passed it)."""
        lr = self._lr(block, req)
        if not block.sync:
            if block.update == "optimizer" and block.reduce == "mean":
                grad = grad / self.trainers  # a new tensor: the wire's view is read-only
            apply_block(block, grad, lr)
            return
        block.round_lr = block.round_lr or (req.trainer, lr)
        block.pending[req.trainer] = grad.clone()
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

    def _push_table(self, name: str, rows: torch.Tensor, grad: torch.Tensor, trainer: int) -> None:
        """Apply (async) or collect (sync) one table's push (``_check_round`` passed it)."""
        table = self.tables[name]
        if not table.sync:
            apply_rows(table, rows, grad, 1)
            return
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
    def pull(self, msg: Message | schema.Pull, deadline: float) -> bytes:
        """The encoded values of the requested blocks and rows, once they reach ``version``
        (encoded under the lock: one copy, never a half-updated block). ``<name>@ids`` asks
        for rows: of table ``name`` by global id, else of block ``name`` by row of its value
        (sorted, unique: the reply is never larger than the block); they come back as
        ``<name>@rows``."""
        req = schema.Pull.of(msg)
        version, trainer = req.version, req.trainer
        with self.cond:
            rows = req.check(self)
            holders: list[DenseBlock | Table] = [self.blocks[k] for k in req.keys]
            holders += [self.tables.get(n) or self.blocks[n] for n in req.ids]
            rollbacks = self.rollbacks

            def ready() -> bool:
                behind = [h for h in holders if h.version < version]
                if behind:
                    self._refuse_lost_pull(trainer, version, behind, rollbacks)
                return not behind

            with self._calling(trainer):
                self._wait(ready, deadline, f"blocks/tables reaching step {version}")
                out = {k: self.blocks[k].value for k in req.keys}
                for name, local in rows.items():
                    out[f"{name}@rows"] = (
                        read_rows(self.tables[name], local)
                        if name in self.tables
                        else self.blocks[name].value.index_select(0, local)
                    )
                return wire.encode(Message({}, out))

    def _refuse_lost_pull(
        self, trainer: int | None, version: int, behind: list[DenseBlock | Table], rollbacks: int
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
            trainer is not None
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

    def barrier(self, msg: Message | schema.Barrier, deadline: float) -> Message:
        """Return once all trainers reached barrier ``generation`` of the barrier ``name``
        (independent counters: the engine's, kv's and fleet's barriers never mix)."""
        req = schema.Barrier.of(msg)
        trainer, name, gen = req.trainer, req.name, req.generation
        with self.cond:
            self.trainers = req.check(self)
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

    def missing(self, meta: dict[str, Any] | schema.Ping) -> list[int]:
        """The trainers this server still lacks for what a stalled call waits on: their pushes
        of the blocks ``keys`` / sync ``tables`` below ``version``, or their arrival at
        ``barrier`` = [name, generation] (names it does not hold are passed over)."""
        req = meta if isinstance(meta, schema.Ping) else schema.Ping.parse(Message(meta))
        with self.cond:
            if req.barrier is not None:
                name, gen = req.barrier
                if self._barrier_over(name, gen):
                    return []
                everyone = self.present() & set(range(self.trainers))
                return sorted(everyone - self.barriers.get((name, gen), set()))
            lacking: set[int] = set()
            held: list[DenseBlock | Table | None] = [self.blocks.get(k) for k in req.keys]
            held += [self.tables.get(n) for n in req.tables]
            for h in held:
                if h is not None and h.sync and h.version < req.version:
                    lacking |= self._expected(h.version) - set(h.pending)
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

    def join(self, msg: Message | schema.Join) -> Message:
        """Trainer ``trainer`` (again) takes part from sync step ``step`` on, or from the
        latest step this server has begun if that is later (the reply's ``step``: the trainer
        asks again with the highest reply). Its pushes of unfinished steps (from an earlier
        process) are discarded. ``rejoined``: it had joined before; ``barrier``: the latest
        completed generation of the engine's barrier."""
        req = schema.Join.of(msg)
        trainer = req.trainer
        with self.cond:
            req.check(self)
            again = trainer in self.joined or trainer in self.back_at
            versions = [b.version for b in self.blocks.values() if b.sync]
            versions += [t.version for t in self.tables.values() if t.sync]
            start = max([req.step, *versions])
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

    def close(self) -> None:
        """The server is stopping: end every wait now and every later one at once
        (``Closing``), so that no call holds its thread for a trainer that will not come."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def _wait(self, ready: Callable[[], bool], deadline: float, what: str) -> None:
        while not ready():
            if self.closed:
                raise Closing(f"parameter server {self.index} is stopping; it waited for {what}")
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
