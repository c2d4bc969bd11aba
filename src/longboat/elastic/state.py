"""`State`: what an elastic job keeps in memory to survive membership changes."""

from __future__ import annotations

import copy
import io
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import longboat.cluster as cluster
from longboat.elastic import world
from longboat.elastic.sampler import ElasticSampler
from longboat.log import get_logger

_log = get_logger("longboat.elastic")
_OWN = frozenset(
    {
        "model",
        "optimizer",
        "sampler",
        "commits",
        "_values",
        "_snapshot",
        "_resets",
        "_checkpoint",
        "_every",
        "_recovering",
        "_has_state",
    }
)


class _TensorTree:
    """A snapshot of a nested state (dicts, lists, tensors, plain values) whose tensors are
    copied into buffers kept from one snapshot to the next (no allocation per commit)."""

    def __init__(self) -> None:
        self.tree: Any = None
        self._buffers: dict[tuple, torch.Tensor] = {}

    def save(self, tree: Any) -> None:
        self.tree = self._copy(tree, ())

    def _copy(self, node: Any, path: tuple) -> Any:
        if isinstance(node, torch.Tensor):
            buf = self._buffers.get(path)
            if buf is None or buf.shape != node.shape or buf.dtype != node.dtype:
                buf = self._buffers[path] = torch.empty_like(node, device=node.device)
            buf.copy_(node.detach())
            return buf
        if isinstance(node, dict):
            return {k: self._copy(v, (*path, k)) for k, v in node.items()}
        if isinstance(node, list | tuple):
            items = [self._copy(v, (*path, i)) for i, v in enumerate(node)]
            return type(node)(items) if isinstance(node, tuple) else items
        return copy.deepcopy(node)

    def fresh(self) -> Any:
        """The snapshot with its tensors cloned (loading must not alias the buffers)."""
        return _clone(self.tree)


def _clone(node: Any) -> Any:
    if isinstance(node, torch.Tensor):
        return node.clone()
    if isinstance(node, dict):
        return {k: _clone(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_clone(v) for v in node]
    if isinstance(node, tuple):
        return tuple(_clone(v) for v in node)
    return copy.deepcopy(node)


class State:
    """The model, optimizer, sampler and your own values of an elastic job.

    ``commit()`` snapshots them in memory (call it after every optimizer step, or every few);
    ``restore()`` goes back to the last snapshot; ``sync()`` makes every rank, newcomers
    included, take the state of the rank that committed most recently. ``lb.elastic.run``
    calls restore and sync for you. Your values are attributes: ``State(model=m, epoch=0)``
    then ``state.epoch += 1``. They must be tensors, numbers, strings, or lists/dicts of
    those (they travel with ``torch.save`` and load with ``weights_only=True``).

    ``checkpoint`` (a file path) and ``checkpoint_every=N`` also write the state to disk,
    atomically, every N commits (by rank 0), for restarts of the whole job.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        sampler: ElasticSampler | None = None,
        *,
        checkpoint: str | os.PathLike | None = None,
        checkpoint_every: int = 0,
        **values: Any,
    ):
        if checkpoint_every < 0 or (checkpoint_every and checkpoint is None):
            raise ValueError("checkpoint_every=N needs checkpoint=PATH and N >= 1")
        clash = sorted(set(values) & _OWN)
        if clash:
            raise ValueError(f"State values may not be named {clash}: these names are taken")
        object.__setattr__(self, "_values", dict(values))
        self.model = model
        self.optimizer = optimizer
        self.sampler = sampler
        self.commits = 0
        self._snapshot = {"model": _TensorTree(), "optimizer": _TensorTree(), "rest": None}
        self._resets: list[Callable[[], None]] = []
        self._checkpoint = Path(checkpoint) if checkpoint is not None else None
        self._every = checkpoint_every
        self._recovering: float | None = None
        self._has_state = False  # until the first sync: a rank that joins late has none
        _check_model(model)
        self.save()

    # -- user values as attributes --------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("_values", {})
        if name in values:
            return values[name]
        raise AttributeError(f"State has no value {name!r} (give it as State({name}=...))")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN or name.startswith("__"):
            object.__setattr__(self, name, value)
        else:
            self._values[name] = value

    # -- snapshot ----------------------------------------------------------------------------

    def save(self) -> None:
        """Snapshot everything in memory (no communication)."""
        if self.model is not None:
            self._snapshot["model"].save(self.model.state_dict())
        if self.optimizer is not None:
            self._snapshot["optimizer"].save(self.optimizer.state_dict())
        self._snapshot["rest"] = {
            "commits": self.commits,
            "sampler": self.sampler.state_dict() if self.sampler is not None else None,
            "values": copy.deepcopy(self._values),
        }

    def commit(self) -> None:
        """Count a step done, snapshot it, and move to a new membership if one is waiting.

        Raises ``MembershipChanged`` (caught by ``lb.elastic.run``) on every rank at the same
        commit when a node joined or left.
        """
        self.commits += 1
        self.save()
        world.record_commits(self.commits)
        if self._recovering is not None:
            _log.warning(
                "recovered: first step committed %.2f s after the failure",
                time.monotonic() - self._recovering,
            )
            self._recovering = None
        if self._every and self.commits % self._every == 0:
            self.write_checkpoint()
        self.check_membership()

    def check_membership(self) -> None:
        """Collective: raise ``MembershipChanged`` if any rank's launcher published a round."""
        if world.change_pending():
            raise world.MembershipChanged("a node joined or left")

    def restore(self) -> None:
        """Go back to the last snapshot."""
        if self.model is not None and self._snapshot["model"].tree is not None:
            self.model.load_state_dict(self._snapshot["model"].fresh())
        if self.optimizer is not None and self._snapshot["optimizer"].tree is not None:
            self.optimizer.load_state_dict(self._snapshot["optimizer"].fresh())
        rest = self._snapshot["rest"]
        self.commits = rest["commits"]
        if self.sampler is not None and rest["sampler"] is not None:
            self.sampler.load_state_dict(_clone(rest["sampler"]))
        object.__setattr__(self, "_values", copy.deepcopy(rest["values"]))

    # -- across ranks ------------------------------------------------------------------------

    def sync(self) -> int:
        """Collective: every rank takes the state of the rank with the most commits (the lowest
        such rank); returns that rank. Nothing moves when every rank has the same count."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            self._reshard()
            return 0
        counts = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size())]
        mine = self.commits if self._has_state else -1  # a newcomer has nothing to give
        dist.all_gather(counts, torch.tensor([mine]))
        values = [int(c.item()) for c in counts]
        source = values.index(max(values))
        if len(set(values)) > 1:
            self._receive(self._broadcast_payload(source), source)
        self._has_state = True
        self._reshard()
        return source

    def _broadcast_payload(self, source: int) -> bytes | None:
        payload = torch.empty(0, dtype=torch.uint8)
        if dist.get_rank() == source:
            buffer = io.BytesIO()
            torch.save(self._payload(), buffer)
            payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        size = torch.tensor([payload.numel()])
        dist.broadcast(size, source)
        if dist.get_rank() != source:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(payload, source)
        return None if dist.get_rank() == source else payload.numpy().tobytes()

    def _payload(self) -> dict[str, Any]:
        return {
            "commits": self.commits,
            "model": self.model.state_dict() if self.model is not None else None,
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "sampler": self.sampler.state_dict() if self.sampler is not None else None,
            "values": self._values,
        }

    def _receive(self, data: bytes | None, source: int) -> None:
        if data is not None:
            self._load(torch.load(io.BytesIO(data), weights_only=True))
            _log.info("took the state of rank %d (%d commits)", source, self.commits)
        self.save()

    def _load(self, payload: dict[str, Any]) -> None:
        self.commits = int(payload["commits"])
        if self.model is not None and payload["model"] is not None:
            self.model.load_state_dict(payload["model"])
        if self.optimizer is not None and payload["optimizer"] is not None:
            self.optimizer.load_state_dict(payload["optimizer"])
        if self.sampler is not None and payload["sampler"] is not None:
            self.sampler.load_state_dict(payload["sampler"])
        object.__setattr__(self, "_values", dict(payload["values"]))

    def _reshard(self) -> None:
        if self.sampler is not None:
            self.sampler.reshard(cluster.rank(), cluster.world_size())

    # -- resets ------------------------------------------------------------------------------

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Call these (in order) after every membership change, once the new world is formed
        and before the state is synced, e.g. to scale the learning rate by
        ``lb.world_size()``."""
        self._resets.extend(callbacks)

    def on_reset(self) -> None:
        """After a new world formed: rebuild the model's reducer, then the user's callbacks."""
        from longboat.collective.model import DistributedModel
        from longboat.collective.rebuild import rebuild

        if isinstance(self.model, DistributedModel):
            rebuild(self.model, self.optimizer)
        for callback in self._resets:
            callback()

    def recovering_since(self, began: float) -> None:
        """Report, at the next commit, how long recovery from a failure at ``began`` took."""
        self._recovering = began

    # -- disk --------------------------------------------------------------------------------

    def write_checkpoint(self) -> None:
        """Rank 0 writes the state to ``checkpoint`` (temporary file, then rename)."""
        if self._checkpoint is None or cluster.rank() != 0:
            return
        self._checkpoint.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._checkpoint.with_name(f".{self._checkpoint.name}.writing")
        torch.save(self._payload(), tmp)
        os.replace(tmp, self._checkpoint)

    def load_checkpoint(self) -> bool:
        """Load ``checkpoint`` if it exists (e.g. when the whole job restarts); True if loaded."""
        if self._checkpoint is None or not self._checkpoint.exists():
            return False
        self._load(torch.load(self._checkpoint, weights_only=True))
        self._has_state = True
        self.save()
        return True


def _check_model(model: nn.Module | None) -> None:
    from longboat.collective.model import DistributedModel
    from longboat.collective.rebuild import check_rebuildable

    if isinstance(model, DistributedModel):
        check_rebuildable(model)
