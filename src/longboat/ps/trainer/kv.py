"""Key-value access to the parameter servers (MXNet KVStore style): ``init``, ``push``, ``pull``.

    kv = KVClient(servers, token, trainer=rank, trainers=n, sync=True)
    kv.init("w", torch.zeros(1000, 16))   # the first init of a key wins; later ones are ignored
    kv.push("w", grad)                    # sync: servers average all trainers' pushes, then update
    w = kv.pull("w")                      # sync: waits for this trainer's pushes to be applied
    r = kv.pull_rows("w", ids)            # rows ids of w: only they travel (w[ids])

A value is split along dim 0 like model parameters (``plan.split_rows``); block ``i`` of key
``k`` lives on server ``(crc32(k) + i) % num_servers`` (deterministic, no salted hashing).
Without ``optimizer`` a push *replaces* the value (MXNet's default updater, after combining the
trainers' pushes in sync mode); with ``optimizer="sgd"|"adam"|"adagrad"`` and ``hparams`` the
servers treat pushes as gradients. ``reduce`` says how one step's pushes combine: "mean"
(longboat's default) or "sum" (MXNet's). ``servers`` may also be a ``LocalServers`` (in-process
states, no sockets). ``longboat.kvstore`` builds on this class.
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch

from longboat.ps.server.local import LocalServers
from longboat.ps.shared.wire import Message, chunks_by_bytes
from longboat.ps.trainer import settings
from longboat.ps.trainer.client import Client
from longboat.ps.trainer.plan import DEFAULT_MAX_BLOCK_NUMEL, DEFAULT_MIN_BLOCK_SIZE, split_rows

_PREFIX = "kv:"
# what a part carries to its server: a push's rows; a pull's ids, or None for a whole block
_Payload = TypeVar("_Payload", bound=torch.Tensor | None)


class KVClient:
    """One trainer's key-value view of the servers at ``servers``."""

    def __init__(
        self,
        servers: Sequence[str] | LocalServers,
        token: str = "",
        *,
        trainer: int = 0,
        trainers: int = 1,
        sync: bool = False,
        optimizer: str | None = None,
        hparams: dict[str, Any] | None = None,
        reduce: str = "mean",
        min_block_size: int = DEFAULT_MIN_BLOCK_SIZE,
        timeout: float | None = None,
    ) -> None:
        if not 0 <= trainer < trainers:
            raise ValueError(f"kv trainer index {trainer} is not in [0, {trainers})")
        self.client: Client | LocalServers = (
            servers
            if isinstance(servers, LocalServers)
            else Client(servers, token, timeout=timeout)
        )
        self.client.connect()
        self.trainer, self.trainers, self.sync = trainer, trainers, bool(sync)
        self.optimizer, self.hparams, self.reduce = optimizer, dict(hparams or {}), reduce
        self.min_block_size = min_block_size
        self._layout: dict[str, tuple[torch.Size, torch.dtype, list[tuple[int, int, int]]]] = {}
        self._pushes: dict[str, int] = {}
        self._barriers: dict[str, int] = {}
        self._agreed = False

    def _blocks(self, key: str, shape: Sequence[int]) -> list[tuple[int, int, int]]:
        """(server, start, stop) of each block of ``key``."""
        n = len(self.client)
        base = zlib.crc32(key.encode())
        ranges = split_rows(tuple(shape), n, self.min_block_size, DEFAULT_MAX_BLOCK_NUMEL)
        return [((base + i) % n, a, b) for i, (a, b) in enumerate(ranges)]

    @staticmethod
    def _rows(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
        return (t.reshape(1) if t.dim() == 0 else t)[a:b]

    def _spec(self, key: str) -> dict[str, Any]:
        spec: dict[str, Any] = {"key": key, "reduce": self.reduce}
        if self.optimizer:
            return spec | {
                "update": "optimizer",
                "optimizer": self.optimizer,
                "hparams": self.hparams,
            }
        return spec | {"update": "assign"}

    def settings(self) -> dict[str, Any]:
        """What every kv client of the job must agree on (``longboat.ps.trainer.settings``)."""
        return {
            "trainers": self.trainers,
            "sync": self.sync,
            "reduce": self.reduce,
            "optimizer": self.optimizer,
            "hparams": self.hparams,
            "min_block_size": self.min_block_size,
        }

    def init(self, key: str, value: torch.Tensor, *, send_value: bool = True) -> None:
        """Create ``key`` on the servers with ``value`` (a no-op for a key that exists).
        ``send_value=False`` records the layout only, for trainers that let another one's value
        win (call ``barrier`` before using the key then). The first init checks this client's
        ``settings()`` against the servers'."""
        if not self._agreed:
            settings.agree(self.client, "kv", self.trainer, self.settings())
            self._agreed = True
        value = value.detach().cpu().contiguous()
        blocks = self._blocks(key, value.shape)
        self._layout[key] = (value.shape, value.dtype, blocks)
        self._pushes.setdefault(key, 0)
        msgs: dict[int, Message] = {}
        for i, (server, a, b) in enumerate(blocks):
            spec = self._spec(f"{_PREFIX}{key}/{i}")
            msg = msgs.setdefault(
                server, Message({"trainers": self.trainers, "sync": self.sync, "blocks": []})
            )
            msg.meta["blocks"].append(spec)
            if send_value:
                msg.tensors[spec["key"]] = self._rows(value, a, b)
        self.client.call_all("init", msgs)

    def set_optimizer(self, optimizer: str | None, hparams: dict[str, Any] | None = None) -> None:
        """Make pushes gradients for ``optimizer`` (None: values to assign) from now on: for
        keys created later, and, sent by this client, for every key it has created (fresh
        optimizer state, values kept). Other trainers call it too, without ``reconfigure``."""
        self.optimizer, self.hparams = optimizer, dict(hparams or {})

    def reconfigure(self) -> None:
        """Send the current optimizer setting to the servers for every key this client knows."""
        msgs: dict[int, Message] = {}
        for key, (_, _, blocks) in self._layout.items():
            for i, (server, _, _) in enumerate(blocks):
                msg = msgs.setdefault(server, Message({"blocks": []}))
                msg.meta["blocks"].append(self._spec(f"{_PREFIX}{key}/{i}"))
        if msgs:
            self.client.call_all("configure", msgs)

    def barrier(self, name: str = "kv") -> None:
        """Return once every trainer called ``barrier(name)`` as often as this one."""
        gen = self._barriers[name] = self._barriers.get(name, 0) + 1
        meta = {"trainer": self.trainer, "trainers": self.trainers, "name": name, "generation": gen}
        self.client.call_all("barrier", {s: Message(dict(meta)) for s in range(len(self.client))})

    def stop(self) -> None:
        """Tell every server this trainer is done (servers end once all trainers are)."""
        if isinstance(self.client, Client):
            msg = {"trainer": self.trainer}
            self.client.call_all("stop", {s: Message(dict(msg)) for s in range(len(self.client))})

    def push(self, key: str, value: torch.Tensor) -> None:
        """Push ``value`` (a gradient, or the new value without an optimizer) for ``key``."""
        self.push_many({key: value})

    def push_many(self, values: Mapping[str, torch.Tensor]) -> None:
        """Push several keys at once: one message per server (and step), sent in parallel."""
        parts: list[tuple[int, int, str, int, torch.Tensor]] = []
        for key, value in values.items():
            shape, dtype, blocks = self._known(key)
            if value.shape != shape:
                raise ValueError(
                    f"kv push {key!r}: shape {tuple(value.shape)}, expected {tuple(shape)}"
                )
            value = value.detach().cpu().to(dtype).contiguous()
            step = self._pushes[key] if self.sync else -1
            for i, (server, a, b) in enumerate(blocks):
                rows = self._rows(value, a, b)
                nbytes = rows.numel() * rows.element_size()
                parts.append((server, step, f"{_PREFIX}{key}/{i}", nbytes, rows))
        calls = [
            self.client.start(server, "push", Message({"trainer": self.trainer, "step": step},
                                                      dict(chunk)))
            for (server, step), chunk in self._grouped(parts)
        ]  # fmt: skip
        for call in calls:
            call.result()
        for key in values:
            self._pushes[key] += 1

    def pull(self, key: str) -> torch.Tensor:
        """The current value of ``key`` (sync: after every trainer's matching push applied)."""
        return self.pull_many([key])[key]

    def pull_many(self, keys: Sequence[str]) -> dict[str, torch.Tensor]:
        """Several keys at once (one message per server and version, in parallel)."""
        parts: list[tuple[int, int, str, int, torch.Tensor | None]] = []
        for key in keys:
            shape, dtype, blocks = self._known(key)
            version = self._version(key)
            row_bytes = math.prod(shape[1:]) * dtype.itemsize
            for i, (server, a, b) in enumerate(blocks):
                parts.append((server, version, f"{_PREFIX}{key}/{i}", (b - a) * row_bytes, None))
        got = self._fetch(parts)
        out = {}
        for key in keys:
            shape, dtype, blocks = self._known(key)
            value = out[key] = torch.empty(shape, dtype=dtype)
            for i, (_, a, b) in enumerate(blocks):
                self._rows(value, a, b).copy_(got[f"{_PREFIX}{key}/{i}"])
        return out

    def pull_rows(self, key: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of ``key``'s value (see ``pull_rows_many``)."""
        return self.pull_rows_many({key: ids})[key]

    def pull_rows_many(self, ids: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rows ``ids[key]`` (integers along dim 0, any order, repeats allowed) of each key's
        value, in the order asked. Only those rows travel: each distinct id once, asked of the
        server holding the block it falls in (no message to servers holding none of them).
        Sync: waits as ``pull`` does; one message per server and version, in parallel."""
        parts: list[tuple[int, int, str, int, torch.Tensor | None]] = []
        wanted: dict[str, tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int]]]] = {}
        for key, asked in ids.items():
            shape, dtype, blocks = self._known(key)
            if not shape:
                raise ValueError(f"kv key {key!r} holds a 0-d value, which has no rows to pull")
            uniq, inverse = torch.unique(_row_ids(key, asked, shape[0]), return_inverse=True)
            bounds = torch.tensor([a for _, a, _ in blocks] + [shape[0]])
            cuts = torch.searchsorted(uniq, bounds).tolist()  # uniq[cuts[i]:cuts[i+1]]: block i
            spans = [(i, lo, hi) for i, (lo, hi) in enumerate(itertools.pairwise(cuts)) if hi > lo]
            wanted[key] = (uniq, inverse, spans)
            per_row = math.prod(shape[1:]) * dtype.itemsize + 8  # the row, and its id asked
            for i, lo, hi in spans:
                server, a, _ = blocks[i]
                block = f"{_PREFIX}{key}/{i}@ids"
                parts.append((server, self._version(key), block, (hi - lo) * per_row,
                              uniq[lo:hi] - a))  # fmt: skip
        got = self._fetch(parts)
        out = {}
        for key, (uniq, inverse, spans) in wanted.items():
            shape, dtype, _ = self._known(key)
            rows = torch.empty(len(uniq), *shape[1:], dtype=dtype)
            for i, lo, hi in spans:
                rows[lo:hi] = got[f"{_PREFIX}{key}/{i}@rows"]
            out[key] = rows[inverse]
        return out

    def _version(self, key: str) -> int:
        """The version a pull of ``key`` waits for (sync: this trainer's pushes of it)."""
        return self._pushes[key] if self.sync else 0

    def _fetch(
        self, parts: list[tuple[int, int, str, int, torch.Tensor | None]]
    ) -> dict[str, torch.Tensor]:
        """Pull ``parts`` (server, version, name, reply bytes, ids): a whole block when ids is
        None (the reply names it ``name``), else rows of it (``name`` is ``<block>@ids``, the
        reply's ``<block>@rows``); every reply's tensors."""
        calls = []
        for (server, version), chunk in self._grouped(parts):
            keys = [k for k, t in chunk if t is None]
            rows = {k: t for k, t in chunk if t is not None}
            msg = Message({"keys": keys, "version": version}, rows)
            calls.append(self.client.start(server, "pull", msg))
        got: dict[str, torch.Tensor] = {}
        for call in calls:
            got.update(call.result().tensors)
        return got

    def _grouped(
        self, parts: list[tuple[int, int, str, int, _Payload]]
    ) -> list[tuple[tuple[int, int], list[tuple[str, _Payload]]]]:
        """``parts`` (server, step, block key, bytes, payload) as messages per (server, step),
        each at most half the message limit (a block larger than that travels alone)."""
        groups: dict[tuple[int, int], list[tuple[tuple[str, _Payload], int]]] = {}
        for server, step, key, nbytes, t in parts:
            groups.setdefault((server, step), []).append(((key, t), nbytes))
        limit = self.client.max_bytes // 2
        return [
            (where, chunk)
            for where, sized in groups.items()
            for chunk in chunks_by_bytes(sized, limit)
        ]

    def _known(self, key: str) -> tuple[torch.Size, torch.dtype, list[tuple[int, int, int]]]:
        if key not in self._layout:
            raise KeyError(f"kv key {key!r} was not init()-ed by this client; call init first")
        return self._layout[key]

    def close(self) -> None:
        self.client.close()


def _row_ids(key: str, ids: torch.Tensor | Sequence[int], num_rows: int) -> torch.Tensor:
    """``ids`` as a flat int64 tensor on the CPU; refuses non-integer ids and ids outside
    ``[0, num_rows)``, naming the key and one bad id."""
    flat = torch.as_tensor(ids).reshape(-1).cpu()
    if flat.is_floating_point() or flat.is_complex() or flat.dtype == torch.bool:
        raise TypeError(f"kv key {key!r}: row ids must be integers, got {flat.dtype}")
    flat = flat.to(torch.int64)
    check_row_ids(flat, num_rows, f"kv key {key!r}")
    return flat


def check_row_ids(ids: torch.Tensor, num_rows: int, what: str = "") -> None:
    """Refuses row ids outside ``[0, num_rows)`` with a ValueError naming one (after
    ``what``, e.g. the key)."""
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= num_rows):
        bad = ids[(ids < 0) | (ids >= num_rows)][0].item()
        prefix = f"{what}: " if what else ""
        raise ValueError(f"{prefix}row id {bad} is not in [0, {num_rows})")
