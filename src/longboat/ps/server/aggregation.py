"""How one parameter server applies pushes to its blocks and table shards.

An async push is applied at once. In sync jobs a block or table waits for the pushes of one
step from every trainer the roster expects at it, sums them in trainer order and divides by
the number of trainers that pushed before applying once (blocks with ``reduce="sum"``, as
MXNet's KVStore has them, skip the division).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from longboat.ps.server import schema
from longboat.ps.server.blocks import DenseBlock, apply_block
from longboat.ps.server.roster import TrainerRoster
from longboat.ps.server.tables import Table, apply_rows
from longboat.ps.shared.request import RequestError, StaleStep

Holder = DenseBlock | Table


class PushAggregator:
    """Server ``index``'s ``blocks`` and ``tables`` (the dicts it is given, shared) and their
    sync steps; ``on_version(step)`` runs once every sync block and table reached ``step``.
    Every method runs under the server state's lock."""

    def __init__(
        self,
        index: int,
        blocks: dict[str, DenseBlock],
        tables: dict[str, Table],
        roster: TrainerRoster,
    ) -> None:
        self.index = index
        self.blocks, self.tables, self.roster = blocks, tables, roster
        self.on_version: Callable[[int], None] | None = None  # periodic checkpoints

    def holders(self) -> list[Holder]:
        return [*self.blocks.values(), *self.tables.values()]

    def sync_versions(self) -> list[int]:
        """The version of every sync block and table."""
        vs = [b.version for b in self.blocks.values() if b.sync]
        vs += [t.version for t in self.tables.values() if t.sync]
        return vs

    @staticmethod
    def lr(block: DenseBlock, req: schema.Push) -> float | None:
        """The learning rate a push gives ``block`` (None: the block's own)."""
        return req.lrs[block.group] if block.group < len(req.lrs) else None

    def check_round(self, req: schema.Push, waits: bool) -> None:
        """Refuse a sync push that does not fit the step its blocks and tables are at:
        another step (StaleStep), a second push of the trainer, another learning rate than
        the step's first push. ``waits``: pass over pushes that wait for the step before."""
        trainer, step = req.trainer, req.step
        held: list[tuple[str, str, Holder]] = [
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
            if isinstance(h, DenseBlock):
                self._check_round_lr(h, name, req)

    def _check_round_lr(self, block: DenseBlock, name: str, req: schema.Push) -> None:
        """Refuse a push with another learning rate than the first push of the step."""
        if block.round_lr is None:
            return
        lr = self.lr(block, req)
        if block.round_lr[1] != lr:
            first, first_lr = block.round_lr
            raise RequestError(
                f"block {name!r} step {req.step}: trainer {req.trainer} pushed with learning "
                f"rate {lr}, trainer {first} with {first_lr} ('lrs'); every trainer "
                "must use the same learning rate (the same optimizer settings and "
                "scheduler)"
            )

    def push_block(self, block: DenseBlock, grad: torch.Tensor, req: schema.Push) -> None:
        """Apply (async) or collect (sync) one block's push (``check_round`` passed it)."""
        lr = self.lr(block, req)
        if not block.sync:
            if block.update == "optimizer" and block.reduce == "mean":
                grad = grad / self.roster.trainers  # a new tensor: the wire's view is read-only
            apply_block(block, grad, lr)
            return
        block.round_lr = block.round_lr or (req.trainer, lr)
        block.pending[req.trainer] = grad.clone()
        self._settle_block(block)

    def push_table(self, name: str, rows: torch.Tensor, grad: torch.Tensor, trainer: int) -> None:
        """Apply (async) or collect (sync) one table's push (``check_round`` passed it)."""
        table = self.tables[name]
        if not table.sync:
            apply_rows(table, rows, grad, 1)
            return
        table.pending[trainer] = (rows.clone(), grad.clone())
        self._settle_table(table)

    def _settle_block(self, block: DenseBlock) -> None:
        """Apply ``block``'s step once every trainer expected at it pushed: their pushes summed
        in trainer order (divided by their number for ``reduce="mean"``)."""
        if not block.pending or not self.roster.expected(block.version) <= block.pending.keys():
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

    def _settle_table(self, table: Table) -> None:
        """Apply ``table``'s step once every trainer expected at it pushed (the mean over them)."""
        if not table.pending or not self.roster.expected(table.version) <= table.pending.keys():
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

    def settle(self) -> None:
        """Complete the steps every expected trainer has pushed."""
        for block in self.blocks.values():
            if block.sync:
                self._settle_block(block)
        for table in self.tables.values():
            if table.sync:
                self._settle_table(table)

    def discard(self, trainer: int) -> int:
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

    def lacking(self, held: list[Holder | None], version: int) -> set[int]:
        """The trainers whose pushes the sync holders of ``held`` below ``version`` lack."""
        lacking: set[int] = set()
        for h in held:
            if h is not None and h.sync and h.version < version:
                lacking |= self.roster.expected(h.version) - set(h.pending)
        return lacking

    def waiting(self) -> dict[int, str]:
        """Each trainer a sync step with pushes of others waits for, with the first such
        step (in the order of blocks, then tables)."""
        out: dict[int, str] = {}
        expected: dict[int, set[int]] = {}  # per step
        for h in self.holders():
            if h.sync and h.pending:
                if h.version not in expected:
                    expected[h.version] = self.roster.expected(h.version)
                for t in sorted(expected[h.version] - h.pending.keys()):
                    out.setdefault(t, f"step {h.version}")
        return out
