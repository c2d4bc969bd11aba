"""What one parameter server holds and how requests change it (no gRPC here: see server.py).

Dense blocks (``blocks.py``) carry their value, their optimizer and a version; sparse tables
(``tables.py``) are sharded by row id (``id % num_servers``) and updated per touched row.
``ServerState`` answers the requests; it composes what it holds: ``PushAggregator``
(``aggregation.py``: how pushes are collected and applied, per sync step), ``TrainerRoster``
(``roster.py``: which trainers are expected, and since when they are silent) and ``Barriers``
(``barriers.py``). Each method takes its request parsed by ``schema.py`` (or a ``Message`` it
parses) and checks it against what the server holds before changing anything: a refused
request leaves the state as it was.

Trainer liveness (sync steps and barriers): a trainer that something waits for and that has been
silent (no call in progress, none ended) for ``trainer_timeout`` seconds is dropped by
``drop_silent``: its pushes of unfinished steps are discarded, those steps complete with the
trainers that pushed (the mean over them) and later steps and barriers stop waiting for it. Its
pushes are refused (``Dropped``) until it calls ``join``, which makes the servers expect it again
from the step it names (the engine does so at connect, and after a refusal).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from longboat.log import get_logger
from longboat.ps.server import schema
from longboat.ps.server.aggregation import Holder, PushAggregator
from longboat.ps.server.barriers import Barriers
from longboat.ps.server.blocks import (
    REDUCES,
    UPDATES,
    DenseBlock,
    block_state,
    load_block,
    make_block,
)
from longboat.ps.server.limits import TRAINER_TIMEOUT_ENV
from longboat.ps.server.roster import TrainerRoster
from longboat.ps.server.schema import SCOPES
from longboat.ps.server.tables import Table, load_table, make_table, read_rows, table_state
from longboat.ps.shared import wire
from longboat.ps.shared.request import Closing, RequestError, StaleStep
from longboat.ps.shared.wire import Message
from longboat.words import plural

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
        self.digest = ""
        self.settings: dict[str, dict[str, Any]] = {}  # scope -> {"set_by", "settings"}
        self.roster = TrainerRoster(index, trainer_timeout, clock)
        self.pushes = PushAggregator(index, self.blocks, self.tables, self.roster)
        self.barriers = Barriers()
        self.rollbacks = 0  # rollbacks begun (restore): sync pulls waiting then are refused
        self.closed = False  # the server is stopping: every wait ends (``close``)

    @property
    def trainers(self) -> int:
        """The job's trainers (0: not known yet)."""
        return self.roster.trainers

    @property
    def on_version(self) -> Callable[[int], None] | None:
        """Called with a step once every sync block and table reached it (periodic
        checkpoints)."""
        return self.pushes.on_version

    @on_version.setter
    def on_version(self, hook: Callable[[int], None] | None) -> None:
        self.pushes.on_version = hook

    # ---- hello ----------------------------------------------------------------------------
    def hello(self, msg: Message | schema.Hello, own: dict[str, Any]) -> Message:
        """Keep the first trainer's ``settings`` of its ``scope``; reply with the kept ones,
        overlaid with this server's ``own`` (and its index, server count, trainer count): the
        trainer compares them with its own (``longboat.ps.trainer.settings``)."""
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
            self.roster.trainers = self.trainers or req.trainers
            self.roster.touch(req.trainer)
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
            lazy = {n: t.lazy for n, t in self.tables.items() if t.lazy is not None}
            if names is True or names is None:
                names = list(lazy)
            if not isinstance(names, list) or not all(
                isinstance(n, str) and n in lazy for n in names
            ):
                raise RequestError(f"shrink: server {self.index} has no lazy table in {names!r}")
            dropped = {n: lazy[n].shrink() for n in names}
            for n, k in dropped.items():
                stats = lazy[n].stats()
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
        """Apply (async) or collect (sync) gradients for blocks and table rows: all of them,
        or (refused) none (``PushAggregator``).

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
                self.roster.refuse_if_dropped(trainer, step)
            self.pushes.check_round(req, waits=True)
            with self.roster.calling(trainer):
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
                self.pushes.check_round(req, waits=False)
                for key, grad in req.dense.items():
                    self.pushes.push_block(self.blocks[key], grad, req)
                for name, (_, grad) in req.sparse.items():
                    self.pushes.push_table(name, rows[name], grad, trainer)
                if synced:  # accepted: a pull of the next step may wait for the others
                    self.roster.pushed(trainer, step)
                self.cond.notify_all()
        return Message({})

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
            holders: list[Holder] = [self.blocks[k] for k in req.keys]
            holders += [self.tables.get(n) or self.blocks[n] for n in req.ids]
            rollbacks = self.rollbacks

            def ready() -> bool:
                behind = [h for h in holders if h.version < version]
                if behind:
                    self._refuse_lost_pull(trainer, version, behind, rollbacks)
                return not behind

            with self.roster.calling(trainer):
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
        self, trainer: int | None, version: int, behind: list[Holder], rollbacks: int
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
        if self.roster.lost_push(trainer, version):
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

    # ---- barriers -------------------------------------------------------------------------
    def barrier(self, msg: Message | schema.Barrier, deadline: float) -> Message:
        """Return once all trainers reached barrier ``generation`` of the barrier ``name``
        (independent counters: the engine's, kv's and fleet's barriers never mix)."""
        req = schema.Barrier.of(msg)
        trainer, name, gen = req.trainer, req.name, req.generation
        with self.cond:
            self.roster.trainers = req.check(self)
            with self.roster.calling(trainer):
                self.barriers.arrive(name, gen, trainer)
                self.cond.notify_all()
                self._wait(
                    lambda: self.barriers.over(name, gen, self.present()),
                    deadline,
                    f"{plural(self.trainers, 'trainer')} at barrier {name or 'step'} {gen}",
                )
                self.barriers.complete(name, gen)
        return Message({})

    def missing(self, meta: dict[str, Any] | schema.Ping) -> list[int]:
        """The trainers this server still lacks for what a stalled call waits on: their pushes
        of the blocks ``keys`` / sync ``tables`` below ``version``, or their arrival at
        ``barrier`` = [name, generation] (names it does not hold are passed over)."""
        req = meta if isinstance(meta, schema.Ping) else schema.Ping.parse(Message(meta))
        with self.cond:
            if req.barrier is not None:
                name, gen = req.barrier
                if self.barriers.over(name, gen, self.present()):
                    return []
                everyone = self.present() & set(range(self.trainers))
                return self.barriers.absent(name, gen, everyone)
            held: list[Holder | None] = [self.blocks.get(k) for k in req.keys]
            held += [self.tables.get(n) for n in req.tables]
            return sorted(self.pushes.lacking(held, req.version))

    # ---- trainer liveness -------------------------------------------------------------------
    def present(self) -> set[int]:
        """The trainers barriers wait for: all but those dropped and not rejoined."""
        return self.roster.present()

    def _lacking(self) -> dict[int, str]:
        """The trainers something waits for (a sync step with pushes of others, a barrier with
        arrivals), each with the first such thing."""
        out = self.pushes.waiting()
        for t, what in self.barriers.waiting(self.present()):
            out.setdefault(t, what)
        return out

    def drop_silent(self) -> list[int]:
        """Drop every trainer something waits for that has been silent (no call in progress,
        none ended) for ``trainer_timeout`` seconds; the trainers dropped (the server calls
        this every fraction of the timeout)."""
        with self.cond:
            now, dropped = self.roster.clock(), []
            for t, what in self._lacking().items():
                silent = self.roster.silence(t, now)
                if silent is None:
                    continue
                self.roster.drop(t, self.version())
                discarded = self.pushes.discard(t)
                dropped.append(t)
                last = self.roster.last_step.get(t)
                log.warning(
                    "server %d: dropped trainer %d: silent for %.1f s (longer than %s=%g s) "
                    "while %s waited for it; its last step: %s%s. The sync steps and barriers "
                    "go on with trainers %s until it rejoins",
                    self.index,
                    t,
                    silent,
                    TRAINER_TIMEOUT_ENV,
                    self.roster.timeout,
                    what,
                    "none" if last is None else last,
                    f" ({discarded} pushes of unfinished steps discarded)" if discarded else "",
                    sorted(self.present()),
                )
            if dropped:
                self._settle()
            return dropped

    def _settle(self) -> None:
        """Complete the steps every expected trainer has pushed; wake the waiting calls."""
        self.pushes.settle()
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
            again = self.roster.rejoined(trainer)
            start = max([req.step, *self.pushes.sync_versions()])
            discarded = self.pushes.discard(trainer)
            self.roster.join(trainer, start)
            self._settle()
            if again:
                log.info(
                    "server %d: trainer %d rejoins; expected again from step %d%s",
                    self.index,
                    trainer,
                    start,
                    f" ({discarded} pushes of an earlier process discarded)" if discarded else "",
                )
            return Message({"step": start, "rejoined": again, "barrier": self.barriers.latest("")})

    # ---- waits ----------------------------------------------------------------------------
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
            self.roster.trainers, self.digest = int(state["trainers"]), str(state["digest"])
            self.settings = json.loads(state.get("settings", "{}"))
            self.blocks.update({k: load_block(s) for k, s in state["blocks"].items()})
            self.tables.update(
                {
                    n: load_table(s, directory, self.max_table_bytes)
                    for n, s in state["tables"].items()
                }
            )
            self.barriers.clear()
            self.roster.rolled_back()  # a rolled-back job waits for every trainer again
            self.cond.notify_all()

    def version(self) -> int:
        """The lowest version over sync blocks and tables (the step this server is at)."""
        with self.cond:
            vs = self.pushes.sync_versions()
            return min(vs) if vs else 0
