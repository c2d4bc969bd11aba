"""The requests that coordinate a job: ``Barrier``, ``Ping``, ``Save``, ``Restore``, ``Configure``,
``Stop``, ``Hello`` and ``Join``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from longboat.ps.server.schema.base import MAX_TRAINERS, Request, ServerView, _trainer_in
from longboat.ps.server.schema.fields import INT64_MAX, Fields, _no_tensors
from longboat.ps.server.schema.specs import block_spec
from longboat.ps.shared.request import RequestError
from longboat.ps.shared.wire import Message

SCOPES = ("engine", "kv")  # who says hello: lb.ps.distribute's engine, or a KVClient


@dataclass(frozen=True)
class Barrier(Request):
    """Trainer ``trainer`` reached generation ``generation`` of the barrier ``name``."""

    method: ClassVar[str] = "barrier"
    trainer: int
    name: str
    generation: int
    trainers: int | None

    @classmethod
    def parse(cls, msg: Message) -> Barrier:
        _no_tensors(msg, "a barrier")
        f = Fields(msg.meta, ("trainer", "name", "generation", "trainers"), what="a barrier")
        return cls(
            f.integer("trainer", 0, hi=MAX_TRAINERS - 1), f.string("name", ""), f.integer("generation", 0),
            f.optional_integer("trainers", lo=1, hi=MAX_TRAINERS),
        )  # fmt: skip

    def check(self, state: ServerView) -> int:
        """The job's trainer count (this request's when the server does not know it yet)."""
        if state.trainers and self.trainers is not None and self.trainers != state.trainers:
            raise RequestError(f"'trainers' is {self.trainers}; the job has {state.trainers}")
        trainers = state.trainers or self.trainers or 0
        limit = max(trainers, 1)
        if self.trainer >= limit:
            raise RequestError(
                f"'trainer' must be in [0, {limit}) (the job's trainers), got {self.trainer}"
            )
        return trainers


@dataclass(frozen=True)
class Ping(Request):
    """Who the server is; with ``keys``/``tables``/``version`` or ``barrier`` also the
    trainers a stalled call waits for (names the server does not hold are ignored)."""

    method: ClassVar[str] = "ping"
    keys: list[str]
    tables: list[str]
    version: int
    barrier: tuple[str, int] | None
    table_stats: bool

    @property
    def asks(self) -> bool:
        return bool(self.keys or self.tables or self.barrier is not None)

    @classmethod
    def parse(cls, msg: Message) -> Ping:
        _no_tensors(msg, "a ping")
        fields = ("keys", "tables", "version", "barrier", "table_stats")
        f = Fields(msg.meta, fields, what="a ping")
        barrier = None
        if f.has("barrier"):
            pair = f.obj["barrier"]
            if not (
                isinstance(pair, list)
                and len(pair) == 2
                and isinstance(pair[0], str)
                and isinstance(pair[1], int)
                and not isinstance(pair[1], bool)
                and 0 <= pair[1] <= INT64_MAX
            ):
                f.fail("barrier", "[name, generation] (a string and an integer >= 0)", pair)
            barrier = (pair[0], pair[1])
        return cls(
            f.strings("keys"), f.strings("tables"), f.integer("version", 0), barrier,
            f.flag("table_stats", False),
        )  # fmt: skip


@dataclass(frozen=True)
class Save(Request):
    """Checkpoint now (no fields)."""

    method: ClassVar[str] = "save"

    @classmethod
    def parse(cls, msg: Message) -> Save:
        _no_tensors(msg, "a save")
        Fields(msg.meta, (), "", "a save")
        return cls()


@dataclass(frozen=True)
class Restore(Request):
    """Trainer ``trainer`` asks to roll back to checkpoint ``step`` (``generation``: its nth)."""

    method: ClassVar[str] = "restore"
    trainer: int
    step: int
    generation: int

    @classmethod
    def parse(cls, msg: Message) -> Restore:
        _no_tensors(msg, "a restore")
        f = Fields(msg.meta, ("trainer", "step", "generation"), what="a restore")
        trainer = f.integer("trainer", 0, hi=MAX_TRAINERS - 1)
        return cls(trainer, f.integer("step", 0), f.integer("generation", 0))

    def check(self, state: ServerView) -> None:
        _trainer_in(state, self.trainer)


@dataclass(frozen=True)
class Configure(Request):
    """New update rules for existing blocks, or (``shrink``) the end of a pass of lazy tables
    (``shrink`` None with ``all_lazy``: every lazy table)."""

    method: ClassVar[str] = "configure"
    blocks: list[dict[str, Any]]
    shrink: list[str] | None
    all_lazy: bool

    @classmethod
    def parse(cls, msg: Message) -> Configure:
        _no_tensors(msg, "a configure")
        f = Fields(msg.meta, ("blocks", "shrink"), what="a configure")
        if f.has("blocks") and f.has("shrink"):
            raise RequestError("'shrink': a configure carries 'blocks' or 'shrink', not both")
        blocks = [block_spec(s, f"blocks[{i}]") for i, s in enumerate(f.array("blocks"))]
        shrink, every = None, False
        if f.has("shrink"):
            if f.obj["shrink"] is True:
                every = True
            else:
                shrink = f.strings("shrink")
        return cls(blocks, shrink, every)

    def check(self, state: ServerView) -> None:
        for i, spec in enumerate(self.blocks):
            block = state.blocks.get(spec["key"])
            if block is None:
                raise RequestError(
                    f"'blocks[{i}].key': server {state.index} holds no block {spec['key']!r}"
                )
            if block.pending:
                raise RequestError(
                    f"'blocks[{i}]': block {spec['key']!r} has pushes of step {block.version} from "
                    f"trainers {sorted(block.pending)} waiting for the others; change the "
                    "optimizer between steps"
                )
        for name in self.shrink or ():
            table = state.tables.get(name)
            if table is None or table.lazy is None:
                raise RequestError(f"'shrink': server {state.index} has no lazy table {name!r}")


@dataclass(frozen=True)
class Stop(Request):
    """Trainer ``trainer`` is done."""

    method: ClassVar[str] = "stop"
    trainer: int

    @classmethod
    def parse(cls, msg: Message) -> Stop:
        _no_tensors(msg, "a stop")
        f = Fields(msg.meta, ("trainer",), what="a stop")
        return cls(f.integer("trainer", 0, hi=MAX_TRAINERS - 1))

    def check(self, state: ServerView) -> None:
        _trainer_in(state, self.trainer)


@dataclass(frozen=True)
class Hello(Request):
    """A connecting trainer's ``settings`` of its ``scope`` (opaque JSON)."""

    method: ClassVar[str] = "hello"
    scope: str
    trainer: int
    settings: dict[str, Any]

    @classmethod
    def parse(cls, msg: Message) -> Hello:
        _no_tensors(msg, "a hello")
        f = Fields(msg.meta, ("scope", "trainer", "settings"), what="a hello")
        scope = f.string("scope", None, SCOPES)
        settings = f.mapping("settings")
        if settings is None:
            f.fail("settings", "given (an object)", None)
        return cls(scope, f.integer("trainer", 0, hi=MAX_TRAINERS - 1), settings)

    def check(self, state: ServerView) -> None:
        if state.trainers:
            _trainer_in(state, self.trainer)


@dataclass(frozen=True)
class Join(Request):
    """Trainer ``trainer`` takes part in the sync steps from ``step`` on."""

    method: ClassVar[str] = "join"
    trainer: int
    step: int

    @classmethod
    def parse(cls, msg: Message) -> Join:
        _no_tensors(msg, "a join")
        f = Fields(msg.meta, ("trainer", "step"), what="a join")
        return cls(f.integer("trainer", 0, hi=MAX_TRAINERS - 1), f.integer("step", 0))

    def check(self, state: ServerView) -> None:
        if not 0 <= self.trainer < state.trainers:
            raise RequestError(
                f"'trainer' must be in [0, {state.trainers}) (the job's trainers), got "
                f"{self.trainer}"
            )
