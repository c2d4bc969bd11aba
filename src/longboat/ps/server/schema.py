"""What each parameter-server request may carry: one validator per request type.

``parse(method, msg)`` reads a decoded frame into its request (``Init``, ``Push``, ...) and
refuses anything the request cannot carry: unknown fields, wrong types, NaN or infinite
numbers, integers outside their range, tensors of the wrong dtype or shape, tensors a request
does not take. A request's ``check(state)`` then refuses what does not fit what the server
holds (trainers outside the job, unknown blocks and tables, ids outside this server's shard,
values of another shape), under the state's lock; it reads the state through ``ServerView``
(``ServerState`` has it). Both run before anything is applied, so a refused request changes
nothing; each refusal is a ``RequestError`` naming the field (the server answers
INVALID_ARGUMENT). ``ServerState`` and ``Server`` take the parsed requests.

A hello's ``settings`` are opaque: the server keeps the first trainer's and sends them back,
and the trainers compare them (``longboat.ps.trainer.settings``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn, Protocol, TypeVar

import torch

from longboat.ps.server.blocks import REDUCES, UPDATES, DenseBlock
from longboat.ps.server.tables import FLOAT_DTYPES, Table, local_rows
from longboat.ps.shared import optim
from longboat.ps.shared.request import PULL_AFTER_PUSH, RequestError
from longboat.ps.shared.wire import Message

INT64_MAX = (1 << 63) - 1
MAX_TRAINERS = 1 << 16  # trainers of one job (the servers keep per-trainer records)
MAX_GROUPS = 1 << 16  # param groups of one optimizer
SCOPES = ("engine", "kv")  # who says hello: lb.ps.distribute's engine, or a KVClient

_Req = TypeVar("_Req", bound="Request")


class ServerView(Protocol):
    """What the requests' checks read of a server's state (``ServerState``)."""

    @property
    def index(self) -> int: ...
    @property
    def num_servers(self) -> int: ...
    @property
    def trainers(self) -> int: ...  # the job's trainers (0: not known yet)
    @property
    def digest(self) -> str: ...
    @property
    def blocks(self) -> Mapping[str, DenseBlock]: ...
    @property
    def tables(self) -> Mapping[str, Table]: ...


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _bound(value: int) -> str:
    return "2**63 - 1" if value == INT64_MAX else str(value)


def _fail(path: str, must: str, value: Any) -> NoReturn:
    raise RequestError(f"{path!r} must be {must}, got {_show(value)}")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _twice(names: list[str]) -> str | None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            return name
        seen.add(name)
    return None


def _finite(value: Any, path: str, skip: str | None = None) -> None:
    """Refuse NaN and infinities anywhere in ``value`` (``skip``: an opaque field)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise RequestError(f"{path!r} must be a finite number, got {value}")
    if isinstance(value, dict):
        for k, v in value.items():
            if k != skip:
                _finite(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _finite(v, f"{path}[{i}]")


class Fields:
    """Typed reads of one JSON object; ``where`` is its path in the meta ("": the meta)."""

    def __init__(self, obj: Any, fields: tuple[str, ...], where: str = "", what: str = "") -> None:
        """``what`` names the object in a refusal of an unknown field (default: ``where``)."""
        self.where = where
        if not isinstance(obj, dict):
            _fail(where or "meta", "an object", obj)
        unknown = sorted(set(obj) - set(fields), key=str)
        if unknown:
            raise RequestError(
                f"unknown field {self.path(unknown[0])!r} ({what or repr(where)} carries "
                f"{', '.join(fields) or 'no fields'})"
            )
        self.obj = obj

    def path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def fail(self, key: str, must: str, value: Any) -> NoReturn:
        _fail(self.path(key), must, value)

    def has(self, key: str) -> bool:
        return key in self.obj

    def integer(self, key: str, default: int | None, lo: int = 0, hi: int = INT64_MAX) -> int:
        """An integer in [lo, hi] (``default`` when absent; None: required)."""
        if key not in self.obj:
            if default is None:
                self.fail(key, f"given (an integer in [{lo}, {_bound(hi)}])", None)
            return default
        value = self.obj[key]
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            self.fail(key, f"an integer in [{lo}, {_bound(hi)}]", value)
        return value

    def optional_integer(self, key: str, lo: int = 0, hi: int = INT64_MAX) -> int | None:
        return self.integer(key, 0, lo, hi) if key in self.obj else None

    def number(
        self, key: str, default: float, lo: float = -math.inf, hi: float = math.inf,
        above: bool = False,
    ) -> float:  # fmt: skip
        """A finite number in [lo, hi] (``above``: (lo, hi])."""
        value = self.obj.get(key, default)
        if not _is_number(value) or not lo <= value <= hi or (above and value == lo):
            bounds = [f"{'>' if above else '>='} {lo:g}"] if lo > -math.inf else []
            bounds += [f"<= {hi:g}"] if hi < math.inf else []
            self.fail(key, " and ".join(["a finite number", *bounds]), value)
        return float(value)

    def string(
        self, key: str, default: str | None, choices: tuple[str, ...] = (), name: bool = False
    ) -> str:
        """A string (one of ``choices``; ``name``: non-empty), ``default`` when absent."""
        if key not in self.obj:
            if default is None:
                self.fail(key, "given" + (f" (one of {list(choices)})" if choices else ""), None)
            return default
        value = self.obj[key]
        if choices and value not in choices:
            self.fail(key, f"one of {list(choices)}", value)
        if not isinstance(value, str) or (name and not value):
            self.fail(key, "a non-empty string" if name else "a string", value)
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.obj.get(key, default)
        if not isinstance(value, bool):
            self.fail(key, "true or false", value)
        return value

    def array(self, key: str) -> list[Any]:
        """A list ([] when absent)."""
        value = self.obj.get(key, [])
        if not isinstance(value, list):
            self.fail(key, "a list", value)
        return value

    def strings(self, key: str) -> list[str]:
        values = self.array(key)
        for i, v in enumerate(values):
            if not isinstance(v, str):
                _fail(f"{self.path(key)}[{i}]", "a string", v)
        return values

    def numbers(self, key: str, lo: float = 0.0) -> list[float]:
        values = self.array(key)
        for i, v in enumerate(values):
            if not _is_number(v) or v < lo:
                _fail(f"{self.path(key)}[{i}]", f"a finite number >= {lo:g}", v)
        return [float(v) for v in values]

    def mapping(self, key: str) -> dict[str, Any] | None:
        """An object (None when absent)."""
        if key not in self.obj:
            return None
        value = self.obj[key]
        if not isinstance(value, dict):
            self.fail(key, "an object", value)
        return value


def _no_tensors(msg: Message, what: str) -> None:
    if msg.tensors:
        name = next(iter(msg.tensors))
        raise RequestError(f"tensor {name!r}: {what} carries no tensors")


def _trainer_in(state: ServerView, trainer: int, field: str = "trainer") -> None:
    """``trainer`` is one of the job's (any index below 1 before the job's size is known)."""
    limit = max(state.trainers, 1)
    if not 0 <= trainer < limit:
        raise RequestError(f"{field!r} must be in [0, {limit}) (the job's trainers), got {trainer}")


def _hparams(f: Fields, optimizer: str | None) -> dict[str, Any]:
    """The ``hparams`` of ``optimizer``: known keys, numbers >= 0 (betas below 1), flags."""
    value = f.mapping("hparams")
    if value is None or optimizer is None:
        return value or {}
    h = Fields(
        value, tuple(optim.HPARAMS[optimizer]), f.path("hparams"),
        f"{f.path('optimizer')!r} {optimizer!r}",
    )  # fmt: skip
    for key, default in optim.HPARAMS[optimizer].items():
        got = value.get(key, default)
        if isinstance(default, bool):
            h.flag(key, default)
        elif isinstance(default, list):
            if not (
                isinstance(got, list)
                and len(got) == len(default)
                and all(_is_number(v) and 0 <= v < 1 for v in got)
            ):
                h.fail(key, f"a list of {len(default)} numbers in [0, 1)", got)
        else:
            h.number(key, 0.0, lo=0.0)
    return value


def block_spec(spec: Any, where: str) -> dict[str, Any]:
    """A block spec of an init or configure: key, update, optimizer, hparams, group, reduce."""
    f = Fields(spec, ("key", "update", "optimizer", "hparams", "group", "reduce"), where)
    f.string("key", None, name=True)
    update = f.string("update", "optimizer", UPDATES)
    name = None
    if update == "optimizer" and not f.has("optimizer"):
        f.fail("optimizer", "given: update 'optimizer' needs an optimizer name", None)
    if f.has("optimizer"):
        name = f.string("optimizer", None, tuple(optim.HPARAMS))
    _hparams(f, name)
    f.integer("group", 0, hi=MAX_GROUPS - 1)
    f.string("reduce", "mean", REDUCES)
    return spec


_TABLE_FIELDS = ("name", "rows", "dim", "dtype", "optimizer", "hparams", "seed", "scale", "lazy")
_LAZY_FIELDS = ("admission", "evict_after", "expected_rows", "storage")


def table_spec(spec: Any, where: str) -> dict[str, Any]:
    """A table spec of an init (``tables.make_table`` checks what it needs on this server)."""
    if isinstance(spec, dict) and not isinstance(spec.get("lazy", False), bool):
        _fail(f"{where}.lazy", "true or false", spec["lazy"])
    lazy = isinstance(spec, dict) and spec.get("lazy") is True
    f = Fields(spec, _TABLE_FIELDS + (_LAZY_FIELDS if lazy else ()), where, "a table spec")
    f.string("name", None, name=True)
    f.flag("lazy", False)
    f.integer("rows", 0 if lazy else None, lo=0 if lazy else 1)
    f.integer("dim", None, lo=1)
    dtype = f.string("dtype", "float32", tuple(FLOAT_DTYPES))
    _hparams(f, f.string("optimizer", None, tuple(optim.ROW_STATES)))
    f.integer("seed", 0)
    f.number("scale", 0.01)
    if lazy:
        admission = f.mapping("admission") or {}
        a = Fields(admission, ("count", "probability"), f.path("admission"))
        a.integer("count", 1, lo=1)
        a.number("probability", 1.0, lo=0.0, hi=1.0, above=True)
        f.integer("evict_after", 0)
        f.integer("expected_rows", 0)
        f.string("storage", dtype, tuple(FLOAT_DTYPES))
    return spec


class Request:
    """A parsed request; ``of`` takes one or parses a ``Message``."""

    method: ClassVar[str]

    @classmethod
    def parse(cls: type[_Req], msg: Message) -> _Req:
        raise NotImplementedError

    @classmethod
    def of(cls: type[_Req], msg: Message | Request) -> _Req:
        if isinstance(msg, cls):
            return msg
        if not isinstance(msg, Message):
            raise TypeError(f"a {cls.method} request is a Message, not a {type(msg).__name__}")
        return cls.parse(msg)


@dataclass(frozen=True)
class Init(Request):
    """Create blocks (valued by ``values``) and tables; idempotent for those that exist."""

    method: ClassVar[str] = "init"
    trainer: int | None
    trainers: int
    sync: bool
    digest: str
    blocks: list[dict[str, Any]]
    tables: list[dict[str, Any]]
    values: dict[str, torch.Tensor]

    @classmethod
    def parse(cls, msg: Message) -> Init:
        fields = ("trainer", "trainers", "sync", "digest", "blocks", "tables")
        f = Fields(msg.meta, fields, what="an init")
        trainers = f.integer("trainers", 1, lo=1, hi=MAX_TRAINERS)
        trainer = f.optional_integer("trainer", hi=trainers - 1)
        blocks = [block_spec(s, f"blocks[{i}]") for i, s in enumerate(f.array("blocks"))]
        tables = [table_spec(s, f"tables[{i}]") for i, s in enumerate(f.array("tables"))]
        for what, specs, key in (("blocks", blocks, "key"), ("tables", tables, "name")):
            twice = _twice([s[key] for s in specs])
            if twice is not None:
                raise RequestError(f"{what!r}: {twice!r} appears twice")
        keys = {s["key"] for s in blocks}
        for name in msg.tensors:
            if name not in keys:
                raise RequestError(f"tensor {name!r}: no spec in 'blocks' has this key")
        return cls(
            trainer, trainers, f.flag("sync", False), f.string("digest", ""), blocks, tables,
            dict(msg.tensors),
        )  # fmt: skip

    def check(self, state: ServerView) -> None:
        if self.digest and state.digest and self.digest != state.digest:
            raise RequestError(
                f"'digest': server {state.index}: this trainer's sharding plan {self.digest} "
                f"differs from the plan {state.digest} the servers were initialised with; every "
                "trainer must build the same model (same parameter names and shapes)"
            )
        if state.trainers and self.trainers != state.trainers:
            raise RequestError(f"'trainers' is {self.trainers}; the job has {state.trainers}")
        for key, value in self.values.items():
            held = state.blocks.get(key)
            if held is not None and (
                value.shape != held.value.shape or value.dtype != held.value.dtype
            ):
                raise RequestError(
                    f"tensor {key!r}: {tuple(value.shape)} {value.dtype}, but the block holds "
                    f"{tuple(held.value.shape)} {held.value.dtype}"
                )


@dataclass(frozen=True)
class Pull(Request):
    """The values of blocks ``keys`` and the rows ``ids`` (``<name>@ids``) at ``version``."""

    method: ClassVar[str] = "pull"
    keys: list[str]
    version: int
    trainer: int | None
    ids: dict[str, torch.Tensor]  # table or block name -> int64 ids

    @classmethod
    def from_meta(cls, meta: Any, where: str, tensors: dict[str, torch.Tensor]) -> Pull:
        f = Fields(
            meta, ("keys", "version", "trainer"), where, f"a pull{' entry' if where else ''}"
        )
        ids = {}
        for name, t in tensors.items():
            if not name.endswith("@ids"):
                raise RequestError(
                    f"tensor {name!r}: a pull carries only '<table>@ids' tensors (the rows it "
                    "wants; a block's rows as '<block>@ids')"
                )
            if t.dtype != torch.int64 or t.dim() != 1:
                raise RequestError(
                    f"tensor {name!r} must be 1-D int64 ids, got {t.dtype} {tuple(t.shape)}"
                )
            ids[name[: -len("@ids")]] = t
        trainer = f.optional_integer("trainer", hi=MAX_TRAINERS - 1)
        return cls(f.strings("keys"), f.integer("version", 0), trainer, ids)

    @classmethod
    def parse(cls, msg: Message) -> Pull:
        return cls.from_meta(msg.meta, "", dict(msg.tensors))

    def check(self, state: ServerView, where: str = "") -> dict[str, torch.Tensor]:
        """The local rows of every ``ids`` entry (tables) or the rows themselves (blocks)."""
        if self.trainer is not None:
            _trainer_in(state, self.trainer, f"{where}.trainer" if where else "trainer")
        for key in self.keys:
            if key not in state.blocks:
                field = f"{where}.keys" if where else "keys"
                raise RequestError(f"{field!r}: server {state.index} holds no block {key!r}")
        rows = {}
        for name, ids in self.ids.items():
            table = state.tables.get(name)
            if table is not None:
                rows[name] = local_rows(name, table, ids, state.index, state.num_servers)
                continue
            block = state.blocks.get(name)
            if block is None:
                raise RequestError(
                    f"tensor '{name}@ids': server {state.index} holds no table or block {name!r}"
                )
            if block.value.dim() == 0:
                raise RequestError(f"tensor '{name}@ids': block {name!r} is 0-d and has no rows")
            n = len(block.value)
            if len(ids) and (
                int(ids[0]) < 0 or int(ids[-1]) >= n or not bool((ids[1:] > ids[:-1]).all())
            ):
                raise RequestError(
                    f"tensor '{name}@ids': rows of block {name!r} must be sorted, unique and in "
                    f"[0, {n})"
                )
            rows[name] = ids
        return rows


@dataclass(frozen=True)
class Push(Request):
    """Gradients (or values) of blocks (``dense``) and table rows (``sparse``) for ``step``;
    ``pull``: the pull to answer with once the push is applied."""

    method: ClassVar[str] = "push"
    trainer: int
    step: int
    lrs: list[float]
    pull: Pull | None
    dense: dict[str, torch.Tensor]
    sparse: dict[str, tuple[torch.Tensor, torch.Tensor]]  # table -> (ids, grad)

    @classmethod
    def parse(cls, msg: Message) -> Push:
        f = Fields(msg.meta, ("trainer", "step", "lrs", PULL_AFTER_PUSH), what="a push")
        trainer = f.integer("trainer", 0, hi=MAX_TRAINERS - 1)
        lrs = f.numbers("lrs")
        then = None
        if f.has(PULL_AFTER_PUSH):
            then = Pull.from_meta(f.mapping(PULL_AFTER_PUSH), PULL_AFTER_PUSH, {})
            if then.trainer is not None and then.trainer != trainer:
                raise RequestError(
                    f"'{PULL_AFTER_PUSH}.trainer' is {then.trainer}, the push's trainer {trainer}"
                )
        dense = {k: t for k, t in msg.tensors.items() if "@" not in k}
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in msg.tensors.items():
            if "@" in key:
                name, _, part = key.rpartition("@")
                if part not in ("ids", "grad"):
                    raise RequestError(f"tensor {key!r}: a sparse entry ends in @ids or @grad")
                parts.setdefault(name, {})[part] = t
        sparse = {}
        for name, p in parts.items():
            ids, grad = p.get("ids"), p.get("grad")
            if ids is None or grad is None:
                raise RequestError(
                    f"table {name!r}: a push needs both '{name}@ids' and '{name}@grad'"
                )
            if ids.dtype != torch.int64 or ids.dim() != 1:
                raise RequestError(
                    f"tensor '{name}@ids' must be 1-D int64, got {ids.dtype} {tuple(ids.shape)}"
                )
            if grad.dim() != 2 or len(grad) != len(ids):
                raise RequestError(
                    f"tensor '{name}@grad' must have one row per id ({len(ids)}), got "
                    f"{tuple(grad.shape)}"
                )
            sparse[name] = (ids, grad)
        return cls(trainer, f.integer("step", -1, lo=-1), lrs, then, dense, sparse)

    def check(self, state: ServerView) -> dict[str, torch.Tensor]:
        """The local rows of each table pushed to (and checks the pull it carries)."""
        _trainer_in(state, self.trainer)
        sync = False
        for key, grad in self.dense.items():
            block = state.blocks.get(key)
            if block is None:
                raise RequestError(f"tensor {key!r}: server {state.index} holds no block {key!r}")
            if grad.shape != block.value.shape or grad.dtype != block.value.dtype:
                raise RequestError(
                    f"tensor {key!r}: pushed {tuple(grad.shape)} {grad.dtype}, block {key!r} "
                    f"holds {tuple(block.value.shape)} {block.value.dtype}"
                )
            if self.lrs and block.group >= len(self.lrs):
                raise RequestError(
                    f"'lrs' has {len(self.lrs)} learning rates; block {key!r} is in param group "
                    f"{block.group}"
                )
            sync |= block.sync
        rows = {}
        for name, (ids, grad) in self.sparse.items():
            table = state.tables.get(name)
            if table is None:
                raise RequestError(f"table {name!r}: server {state.index} holds no such table")
            if grad.shape[1] != table.dim or grad.dtype != table.dtype:
                raise RequestError(
                    f"tensor '{name}@grad': {tuple(grad.shape)} {grad.dtype}, table {name!r} has "
                    f"rows of {table.dim} {table.dtype}"
                )
            rows[name] = local_rows(name, table, ids, state.index, state.num_servers)
            sync |= table.sync
        if sync and self.step < 0:
            raise RequestError(f"'step' must be given (>= 0) for a sync push, got {self.step}")
        if self.pull is not None:
            self.pull.check(state, PULL_AFTER_PUSH)
        return rows


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


REQUESTS: dict[str, type[Request]] = {
    r.method: r
    for r in (Init, Push, Pull, Barrier, Ping, Save, Restore, Configure, Stop, Hello, Join)
}


def parse(method: str, msg: Message) -> Request:
    """The request ``msg`` makes of ``method`` (RequestError naming the field if malformed)."""
    _finite(msg.meta, "", skip="settings" if method == "hello" else None)
    return REQUESTS[method].parse(msg)
