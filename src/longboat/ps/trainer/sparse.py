"""``SparseEmbedding``: an embedding table that lives on the parameter servers, sharded by row id.

Row ``i`` lives on server ``i % num_servers`` at local row ``i // num_servers``. A trainer
pulls only the rows its batch uses (duplicates merged, ``SparseLookups``), and backward produces
row-sparse gradients that ``SparseLookups.push`` sends; the servers update each touched row with the table's own
optimizer (SGD, Adagrad or lazy Adam). Initial values depend only on (seed, row id), never on
the number of servers, so ``initial_weight()`` rebuilds the whole table for a reference run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from longboat.ps.shared.optim import ROW_STATES
from longboat.ps.shared.rows import initial_rows
from longboat.ps.shared.wire import Message
from longboat.ps.trainer.client import PSError

if TYPE_CHECKING:
    from longboat.ps.trainer.client import Call, Client

#: one lookup of a step: the table, its distinct ids, the rows pulled (their .grad after backward)
Lookup = tuple["SparseEmbedding", torch.Tensor, torch.Tensor]
#: a step's row gradients of each table: table name -> (ids, one gradient row per id)
RowGrads = dict[str, tuple[torch.Tensor, torch.Tensor]]


class SparseEmbedding(nn.Module):
    """An embedding table held by the parameter servers (use it inside a model given to
    ``lb.distribute`` with ``Strategy(mode="ps")``).

    ``optimizer`` is "sgd", "adagrad" or "adam" with ``hparams`` (``lr`` and the optimizer's
    own keys, see ``longboat.ps.shared.optim.HPARAMS``); it runs on the servers, per touched row.

    ``lazy=True`` (implied by ``num_embeddings=None``: any int64 id) creates rows on the
    servers on their first admitted update: ``admit_count`` (updates before a row exists) or
    ``admit_probability`` (a fixed draw per id); ``evict_after`` passes without an update drop
    a row at ``lb.ps.shrink()``; ``storage_dtype`` (e.g. torch.float16) stores the rows in
    half precision; ``expected_rows`` preallocates room for that many rows over all servers.
    """

    def __init__(
        self,
        num_embeddings: int | None,
        embedding_dim: int,
        name: str,
        *,
        optimizer: str = "sgd",
        lr: float = 0.01,
        seed: int = 0,
        init_scale: float | None = None,
        dtype: torch.dtype = torch.float32,
        lazy: bool = False,
        admit_count: int = 1,
        admit_probability: float = 1.0,
        evict_after: int = 0,
        storage_dtype: torch.dtype | None = None,
        expected_rows: int = 0,
        **hparams: Any,
    ) -> None:
        super().__init__()
        if optimizer not in ROW_STATES:
            raise ValueError(
                f"SparseEmbedding {name!r}: optimizer must be one of "
                f"{sorted(ROW_STATES)}, got {optimizer!r}"
            )
        self.lazy = lazy or num_embeddings is None
        extras = (admit_count, admit_probability, evict_after, storage_dtype, expected_rows)
        if not self.lazy and extras != (1, 1.0, 0, None, 0):
            raise ValueError(
                f"SparseEmbedding {name!r}: admission, eviction, storage_dtype and "
                "expected_rows need lazy=True"
            )
        if (num_embeddings is not None and num_embeddings < 1) or embedding_dim < 1:
            raise ValueError(f"SparseEmbedding {name!r}: sizes must be >= 1")
        if admit_count < 1 or not 0 < admit_probability <= 1 or evict_after < 0:
            raise ValueError(
                f"SparseEmbedding {name!r}: need admit_count >= 1, 0 < admit_probability <= 1 "
                "and evict_after >= 0"
            )
        self.admit_count, self.admit_probability = admit_count, admit_probability
        self.evict_after, self.storage_dtype = evict_after, storage_dtype
        self.expected_rows = expected_rows
        self.num_embeddings, self.embedding_dim, self.name = num_embeddings, embedding_dim, name
        self.optimizer, self.hparams = optimizer, {"lr": lr, **hparams}
        self.seed, self.dtype = seed, dtype
        self.init_scale = init_scale if init_scale is not None else embedding_dim**-0.5
        self._lookup: Callable[[SparseEmbedding, torch.Tensor], torch.Tensor] | None = None

    def spec(self) -> dict[str, Any]:
        """What the servers need to create their shard of this table (JSON-able)."""
        spec = {
            "name": self.name,
            "rows": self.num_embeddings or 0,
            "dim": self.embedding_dim,
            "dtype": str(self.dtype).removeprefix("torch."),
            "optimizer": self.optimizer,
            "hparams": self.hparams,
            "seed": self.seed,
            "scale": self.init_scale,
        }
        if self.lazy:
            admission = {"count": self.admit_count, "probability": self.admit_probability}
            spec |= {"lazy": True, "admission": admission, "evict_after": self.evict_after}
            spec["expected_rows"] = self.expected_rows
            if self.storage_dtype is not None:
                spec["storage"] = str(self.storage_dtype).removeprefix("torch.")
        return spec

    def initial_weight(self) -> torch.Tensor:
        """The full initial table (for single-process references; allocates it all)."""
        if self.num_embeddings is None:
            raise ValueError(f"SparseEmbedding {self.name!r} has no row count; use initial_rows")
        ids = torch.arange(self.num_embeddings)
        return initial_rows(ids, self.embedding_dim, self.seed, self.init_scale, self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self._lookup is None:
            raise RuntimeError(
                f"SparseEmbedding {self.name!r} has no servers: pass the model to lb.distribute "
                "with Strategy(mode='ps') first (for local training build nn.Embedding from "
                "initial_weight())"
            )
        bound = self.num_embeddings
        if bound is not None and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= bound):
            raise IndexError(
                f"SparseEmbedding {self.name!r}: ids must be in [0, {bound}), "
                f"got min {int(ids.min())} max {int(ids.max())}"
            )
        return self._lookup(self, ids)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, name={self.name!r}, "
            f"optimizer={self.optimizer!r}"
        )


class SparseLookups:
    """A trainer's lookups of its ``tables`` on ``client``'s servers, and the pushes of the row
    gradients they produce (the engine hands ``lookup`` to every table).

    ``version()`` is the step whose update a lookup waits for (0: none); ``before()`` runs first
    (the engine's wait for its pulls in flight); ``training()`` says whether the model records
    gradients; ``waiting(what)`` wraps the blocking wait (the timeline records it);
    ``recover(error)`` runs when a lookup's pull fails (the engine's recovery from a server
    restart: it returns once the servers are back at this step, and the pull is sent again,
    or raises).
    """

    def __init__(
        self,
        tables: list[SparseEmbedding],
        client: Client,
        trainer: int,
        *,
        version: Callable[[], int],
        before: Callable[[], None],
        training: Callable[[], bool],
        waiting: Callable[[str], contextlib.AbstractContextManager[Any]],
        recover: Callable[[PSError], None] | None = None,
    ) -> None:
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"SparseEmbedding names must be unique, got {names}")
        self.tables, self.client, self.trainer = tables, client, trainer
        self._version, self._before, self._training = version, before, training
        self._waiting, self._recover = waiting, recover
        self._lookups: list[Lookup] = []

    def attach(self) -> None:
        """Make every table look its rows up here."""
        for t in self.tables:
            t._lookup = self.lookup

    def detach(self) -> None:
        """Leave the tables without servers (their forward raises)."""
        for t in self.tables:
            t._lookup = None

    def clear(self) -> list[Lookup]:
        """Forget the lookups not pushed yet (returned: ``resume`` takes them back)."""
        lookups, self._lookups = self._lookups, []
        return lookups

    def resume(self, lookups: list[Lookup]) -> None:
        """Record ``lookups`` (from ``clear``) again, before any made since."""
        self._lookups = lookups + self._lookups

    def lookup(self, table: SparseEmbedding, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``table`` for ``ids``: pull each distinct id once, record for the push."""
        self._before()
        uniq, inverse = torch.unique(ids.reshape(-1).to(torch.int64), return_inverse=True)
        version = self._version()
        try:
            rows = self._pull(table, uniq, version)
        except PSError as exc:
            if self._recover is None:
                raise
            self._recover(exc)  # the servers are back at this step: ask again
            rows = self._pull(table, uniq, self._version())
        if torch.is_grad_enabled() and self._training():
            rows.requires_grad_(True)
            self._lookups.append((table, uniq, rows))
        return rows[inverse].reshape(*ids.shape, table.embedding_dim)

    def _pull(self, table: SparseEmbedding, uniq: torch.Tensor, version: int) -> torch.Tensor:
        """The rows of distinct ids ``uniq`` once the servers reached ``version``."""
        servers = len(self.client)
        rows = torch.empty(len(uniq), table.embedding_dim, dtype=table.dtype)
        calls = {}
        for s in range(servers):
            mask = uniq % servers == s
            if bool(mask.any()):
                meta = {"keys": [], "version": version, "trainer": self.trainer}
                msg = Message(meta, {f"{table.name}@ids": uniq[mask]})
                calls[s] = (mask, self.client.start(s, "pull", msg))
        with self._waiting("pull"):
            for mask, call in calls.values():
                rows[mask] = call.result().tensors[f"{table.name}@rows"]
        return rows

    def wait(self, version: int) -> None:
        """Wait until every server's shard of every table reached ``version``."""
        empty = torch.empty(0, dtype=torch.int64)
        meta = {"keys": [], "version": version, "trainer": self.trainer}
        msg = Message(meta, {f"{t.name}@ids": empty for t in self.tables})
        self.client.call_all("pull", {s: msg for s in range(len(self.client))})

    def gradients(self) -> RowGrads:
        """The row gradients of the lookups recorded so far, per table (new tensors; the
        lookups stay recorded)."""
        merged: RowGrads = {}
        for table in self.tables:
            mine = [(u, r) for t, u, r in self._lookups if t is table]
            ids = torch.cat([u for u, _ in mine]) if mine else torch.empty(0, dtype=torch.int64)
            grads = [r.grad if r.grad is not None else torch.zeros_like(r) for _, r in mine]
            dim = table.embedding_dim
            merged[table.name] = (
                ids,
                torch.cat(grads) if grads else torch.empty(0, dim, dtype=table.dtype),
            )
        return merged

    def push(self, step: int, every_server: bool) -> list[Call]:
        """Start the pushes of the recorded lookups' row gradients (``every_server``: also an
        empty push to servers without rows, as sync steps need one from every trainer)."""
        if not self.tables or (not self._lookups and not every_server):
            self._lookups = []
            return []
        merged = self.gradients()
        self._lookups = []
        return self.send(merged, step, every_server)

    def send(self, merged: RowGrads, step: int, every_server: bool) -> list[Call]:
        """Start the pushes of ``merged`` row gradients of ``step``, split by server."""
        servers = len(self.client)
        calls = []
        for s in range(servers):
            tensors = {}
            for name, (ids, grads) in merged.items():
                mask = ids % servers == s
                if every_server or bool(mask.any()):
                    tensors[f"{name}@ids"], tensors[f"{name}@grad"] = ids[mask], grads[mask]
            if tensors:
                meta = {"trainer": self.trainer, "step": step}
                calls.append(self.client.start(s, "push", Message(meta, tensors)))
        return calls
