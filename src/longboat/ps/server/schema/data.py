"""The requests that move values: ``Init`` (blocks and tables a server holds), ``Pull`` and
``Push`` (of dense blocks and sparse rows)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from longboat.ps.server.schema.base import MAX_TRAINERS, Request, ServerView, _trainer_in
from longboat.ps.server.schema.fields import Fields, _twice
from longboat.ps.server.schema.specs import block_spec, table_spec
from longboat.ps.server.tables import local_rows
from longboat.ps.shared.request import PULL_AFTER_PUSH, RequestError
from longboat.ps.shared.wire import Message


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
