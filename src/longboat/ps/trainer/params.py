"""A trainer's dense parameters as the servers hold them (the sharding plan's blocks): pushes
of gradients or deltas, pulls of values, the pulls still in flight, and the trainers' barrier."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from longboat.ps.shared.request import PULL_AFTER_PUSH
from longboat.ps.shared.wire import Message, chunks_by_bytes
from longboat.ps.trainer.client import Call, Client
from longboat.ps.trainer.plan import Block, ShardingPlan

Waiting = Callable[[str], contextlib.AbstractContextManager[Any]]


def part(t: torch.Tensor, b: Block) -> torch.Tensor:
    """Block ``b``'s rows of tensor ``t`` (a view)."""
    return (t.reshape(1) if t.dim() == 0 else t)[b.start : b.stop].reshape(b.shape)


def wait_all(calls: Iterable[Call]) -> None:
    """Wait for every call's reply (raising the first failure)."""
    for call in calls:
        call.result()


class DenseParams:
    """``params`` (name, parameter) split into ``plan``'s blocks on ``client``'s servers.

    ``optimizer`` gives the learning rates every push carries; ``waiting(what)`` wraps the
    training thread's blocking waits (the timeline records them).
    """

    def __init__(
        self,
        params: list[tuple[str, torch.nn.Parameter]],
        plan: ShardingPlan,
        client: Client,
        optimizer: torch.optim.Optimizer,
        trainer: int,
        waiting: Waiting,
    ) -> None:
        self.params, self.plan, self.client = params, plan, client
        self.optimizer, self.trainer, self.waiting = optimizer, trainer, waiting
        self.blocks = [plan.of_param(n) for n, _ in params]
        self.pending: dict[int, list[Call]] = {}  # pulls in flight, per server
        self._chunk_bytes = client.max_bytes // 2
        self._pull_keys = [  # each server's block keys, as one pull reply each can hold
            list(
                chunks_by_bytes(
                    [(b.key, math.prod(b.shape) * 4) for b in plan.of_server(s)],  # float32
                    self._chunk_bytes,
                )
            )
            for s in range(len(client))
        ]
        self._barrier_gen = 0

    def __len__(self) -> int:
        return len(self.params)

    def grads(self) -> list[torch.Tensor]:
        """Every parameter's gradient (zeros where it has none)."""
        return [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in self.params]

    def push_grads(self, indices: Iterable[int], step: int, pull: int | None = None) -> list[Call]:
        """Start the pushes of the gradients of parameters ``indices`` for ``step`` (``pull``:
        see ``push``)."""
        idx = list(indices)
        grads = [self.params[i][1].grad for i in idx]
        tensors = [
            g if g is not None else torch.zeros_like(self.params[i][1])
            for i, g in zip(idx, grads, strict=True)
        ]
        return self.push(idx, tensors, step, aligned=True, pull=pull)

    def push(
        self,
        indices: Iterable[int],
        tensors: Sequence[torch.Tensor],
        step: int,
        aligned: bool = False,
        pull: int | None = None,
    ) -> list[Call]:
        """Push ``tensors`` (one per index, or one per parameter unless ``aligned``).

        ``pull``: the last push to each server also asks for all of that server's blocks at
        version ``pull`` (when they fit one reply): its reply is that pull's, and one call
        per server and step is saved. ``pulls_in(calls)`` picks those calls out.
        """
        idx = list(indices)
        per_server: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for j, i in enumerate(idx):
            t = tensors[j] if aligned else tensors[i]
            for b in self.blocks[i]:
                per_server.setdefault(b.server, []).append((b.key, part(t, b)))
        lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        meta = {"trainer": self.trainer, "step": step, "lrs": lrs}
        calls = []
        for s, items in per_server.items():
            chunks = list(
                chunks_by_bytes(
                    ((item, item[1].numel() * item[1].element_size()) for item in items),
                    self._chunk_bytes,
                )
            )
            for n, chunk in enumerate(chunks, 1):
                then = self._pull_meta(s, pull) if n == len(chunks) else None
                call_meta = meta if then is None else {**meta, PULL_AFTER_PUSH: then}
                calls.append(self.client.start(s, "push", Message(call_meta, dict(chunk))))
        return calls

    def _pull_meta(self, server: int, version: int | None) -> dict[str, Any] | None:
        """What a pull of all of ``server``'s blocks at ``version`` asks (None: no pull asked,
        or the blocks need more than one reply)."""
        if version is None or len(self._pull_keys[server]) != 1:
            return None
        return {"keys": self._pull_keys[server][0], "version": version, "trainer": self.trainer}

    @staticmethod
    def pulls_in(calls: Iterable[Call]) -> tuple[list[Call], dict[int, list[Call]]]:
        """``calls`` split into plain pushes and, per server, the pushes that also pull."""
        pushes: list[Call] = []
        pulls: dict[int, list[Call]] = {}
        for call in calls:
            if call.msg is not None and PULL_AFTER_PUSH in call.msg.meta:
                pulls.setdefault(call.server, []).append(call)
            else:
                pushes.append(call)
        return pushes, pulls

    def start_pulls(
        self, version: int, have: Mapping[int, list[Call]] | None = None
    ) -> dict[int, list[Call]]:
        """Start the pulls of every block, answered once it reaches ``version``; servers in
        ``have`` (pulls already asked for, e.g. by ``push(..., pull=version)``) are skipped
        and their calls returned with the new ones."""
        pulls: dict[int, list[Call]] = {s: list(c) for s, c in (have or {}).items()}
        for s in range(len(self.client)):
            if s in pulls:
                continue
            for keys in self._pull_keys[s]:
                meta = {"keys": keys, "version": version, "trainer": self.trainer}
                pulls.setdefault(s, []).append(self.client.start(s, "pull", Message(meta)))
        return pulls

    @staticmethod
    def collect(pulls: Mapping[int, list[Call]]) -> dict[str, torch.Tensor]:
        """The values of ``pulls`` by block key (waits for them)."""
        out: dict[str, torch.Tensor] = {}
        for calls in pulls.values():
            for call in calls:
                out.update(call.result().tensors)
        return out

    def copy_in(self, values: Mapping[str, torch.Tensor]) -> None:
        """Write block ``values`` into the parameters."""
        with torch.no_grad():
            for (_, p), blocks in zip(self.params, self.blocks, strict=True):
                for b in blocks:
                    if b.key in values:
                        part(p.data, b).copy_(values[b.key])

    def pull(self, version: int) -> None:
        """Pull every block at ``version`` into the parameters."""
        with self.waiting("pull"):
            values = self.collect(self.start_pulls(version))
        self.copy_in(values)

    def synchronize(self) -> None:
        """Wait for the pulls still in flight and write them into the parameters."""
        pending, self.pending = self.pending, {}
        if pending:
            with self.waiting("pull"):
                values = self.collect(pending)
            self.copy_in(values)

    def barrier(self) -> None:
        """Wait until every trainer reached its next barrier."""
        self._barrier_gen += 1
        meta = {"trainer": self.trainer, "name": "", "generation": self._barrier_gen}
        with self.waiting("barrier"):
            self.client.call_all("barrier", {s: Message(meta) for s in range(len(self.client))})
