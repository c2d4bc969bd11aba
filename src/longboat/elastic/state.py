"""`State`: what an elastic job keeps in memory to survive membership changes."""

from __future__ import annotations

import copy
import io
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import longboat.cluster as cluster
from longboat.comm.exchange import control_device
from longboat.elastic import node_copy, optimizer_state, recovery, world
from longboat.elastic.membership import ElasticError
from longboat.elastic.reshard import ShardsLostError, agree_on_checkpoint
from longboat.elastic.sampler import ElasticSampler
from longboat.elastic.snapshot import TensorTree, clone, hash_tree
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
        "_node_copy",
        "_copy_writer",
    }
)
#: What the digest compared after every membership change covers, in its order.
DIGEST_PARTS = ("commit count", "parameters", "optimizer state", "sampler progress")


class StateMismatchError(ElasticError):
    """After a membership change, some ranks do not hold the state every rank should share."""


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

    In an elastic job each commit is also kept on the rank's node, outside the rank process
    (`longboat.elastic.node_copy`), so that ranks restarted there after every rank died resume
    from it; ``node_copy=False`` turns that off. A round never resumes below the highest
    commit the job reached without saying so, and never from nothing (`recovery`).
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        sampler: ElasticSampler | None = None,
        *,
        checkpoint: str | os.PathLike | None = None,
        checkpoint_every: int = 0,
        node_copy: bool = True,
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
        self._snapshot = {"model": TensorTree(), "optimizer": TensorTree(), "rest": None}
        self._resets: list[Callable[[], None]] = []
        self._checkpoint = Path(checkpoint) if checkpoint is not None else None
        self._every = checkpoint_every
        self._recovering: float | None = None
        self._has_state = False  # until the first sync: a rank that joins late has none
        self._node_copy = node_copy
        self._copy_writer: node_copy.NodeCopy | None = None  # created at the first commit
        _check_model(model, optimizer)
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
        if self._whole_model():
            self._snapshot["model"].save(self.model.state_dict())
        if self.optimizer is not None:
            self._snapshot["optimizer"].save(optimizer_state.snapshot(self.optimizer))
        self._snapshot["rest"] = {
            "commits": self.commits,
            "sampler": self.sampler.state_dict() if self.sampler is not None else None,
            "values": copy.deepcopy(self._values),
            "loss_scale": self._loss_scale(),
        }

    def commit(self) -> None:
        """Count a step done, snapshot it, and move to a new membership if one is waiting.

        Raises ``MembershipChanged`` (caught by ``lb.elastic.run``) on every rank at the same
        commit when a node joined or left.
        """
        self.commits += 1
        self.save()
        self._keep_on_node()
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

    def _keep_on_node(self) -> None:
        """Hand this commit to the node's copy (elastic jobs; unsharded: local rank 0 only,
        since every rank holds the same state)."""
        if not self._node_copy:
            return
        if self._copy_writer is None:
            directory = node_copy.copy_dir()
            if directory is None or self._copy_source() != cluster.local_rank():
                return
            self._copy_writer = node_copy.NodeCopy(directory, cluster.local_rank())
        snapshot = self._snapshot
        parts = {"model": snapshot["model"].tree, "optimizer": snapshot["optimizer"].tree}
        self._copy_writer.offer(self.commits, {**parts, "rest": snapshot["rest"]})

    def _whole_model(self) -> bool:
        """Whether the model's ``state_dict`` is snapshotted: not at sharding stage 3, whose
        parameters' shards the optimizer's snapshot holds."""
        return self.model is not None and optimizer_state.fully_sharded(self.optimizer) is None

    def _copy_source(self) -> int:
        """The local rank whose node copy this rank writes or reads: its own with a sharded
        optimizer (its slices), else local rank 0's (every rank holds the same state)."""
        return cluster.local_rank() if optimizer_state.is_sharded(self.optimizer) else 0

    def flush_node_copy(self, timeout: float = 60.0) -> bool:
        """Wait until this rank's last commit is written to its node copy (True when it is,
        or when this rank writes none)."""
        return self._copy_writer is None or self._copy_writer.flush(timeout)

    def _take_node_copy(self) -> None:
        """A rank (re)started on a node that kept a copy of an earlier rank's last commit
        holds that state again, as a survivor rolled back to it would."""
        directory = node_copy.copy_dir()
        if not self._node_copy or directory is None:
            return
        found = node_copy.newest(directory, self._copy_source())
        if found is None:
            return
        commits, saved = found
        self._snapshot["model"].tree = saved["model"]
        self._snapshot["optimizer"].tree = saved["optimizer"]
        self._snapshot["rest"] = saved["rest"]
        self.restore()
        self._has_state = True
        _log.warning("took this node's copy of commit %d (kept when its ranks died)", commits)

    def _copies_note(self) -> str:
        """Where node copies were looked for, for `recovery.check`'s message."""
        directory = node_copy.copy_dir()
        if directory is None:
            return "not an elastic job"
        if not self._node_copy:
            return "node copies are off: lb.elastic.State(node_copy=False)"
        return f"none in {directory}"

    def check_membership(self) -> None:
        """Collective: raise ``MembershipChanged`` if any rank's launcher published a round."""
        if world.change_pending():
            raise world.MembershipChanged("a node joined or left")

    def restore(self) -> None:
        """Go back to the last snapshot."""
        drop = getattr(self.model, "drop_pending_writes", None)
        if drop is not None:  # sharding's gathers of a world that may have lost a rank
            drop()
        if self.model is not None and self._snapshot["model"].tree is not None:
            self.model.load_state_dict(self._snapshot["model"].fresh())
        if self.optimizer is not None and self._snapshot["optimizer"].tree is not None:
            optimizer_state.restore(self.optimizer, self._snapshot["optimizer"].fresh())
        rest = self._snapshot["rest"]
        self.commits = rest["commits"]
        if self.sampler is not None and rest["sampler"] is not None:
            self.sampler.load_state_dict(clone(rest["sampler"]))
        object.__setattr__(self, "_values", copy.deepcopy(rest["values"]))
        self._set_loss_scale(rest.get("loss_scale"))

    def _loss_scale(self) -> dict[str, Any] | None:
        """float16 AMP's loss scale and its counters, kept like the optimizer's state: a
        change of world or a rollback goes on with the scale the job reached."""
        scaler = optimizer_state.loss_scaler(self.optimizer)
        return scaler.state_dict() if scaler is not None else None

    def _set_loss_scale(self, saved: dict[str, Any] | None) -> None:
        scaler = optimizer_state.loss_scaler(self.optimizer)
        if scaler is not None and saved is not None:
            scaler.load_state_dict(saved)

    # -- across ranks ------------------------------------------------------------------------

    @property
    def holds_state(self) -> bool:
        """True once this rank holds the job's state (after its first ``sync``, or after
        ``load_checkpoint``); a rank that joins a running job holds none until it receives it."""
        return self._has_state

    def sync(self) -> int:
        """Collective: every rank takes the state of the rank with the most commits (the lowest
        such rank); returns that rank. A rank that holds no state yet (it joined late) always
        receives it; nothing moves when every rank holds the same count. Then every rank's
        digest of its state is compared: `StateMismatchError` (on every rank) names the ranks
        whose state differs from that rank's. A sharded optimizer's slices are resharded over
        the world from the ranks' last commits; where some left with a rank, every rank
        loads the last sharded ``checkpoint`` instead, else ``ShardsLostError``. A rank
        without state first takes its node's copy of an earlier rank's last commit, if one
        was kept; `recovery.StateLostError` (on every rank) when no rank holds
        state although the job had committed steps."""
        if not self._has_state:
            self._take_node_copy()
        mine = self.commits if self._has_state else -1  # a newcomer has nothing to give
        held = self._snapshot["optimizer"].tree if self._has_state else None
        recorded = world.recorded_commits()
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            recovery.check(recovery.Resume([mine], recorded), self._copies_note())
            self._has_state = True  # alone, this rank holds the state: a joiner receives it
            if dist.is_initialized() and self._reshard_state(held, mine):
                self.save()
            self._reshard()
            return 0
        device = control_device()
        counts = [
            torch.zeros(2, dtype=torch.long, device=device) for _ in range(dist.get_world_size())
        ]
        dist.all_gather(counts, torch.tensor([mine, recorded], device=device))
        pairs = [[int(v) for v in c.tolist()] for c in counts]
        values = [held_commits for held_commits, _ in pairs]
        resume = recovery.Resume(values, max(reached for _, reached in pairs))
        recovery.check(resume, self._copies_note())
        source = values.index(max(values))
        received = len(set(values)) > 1
        if received:
            self._receive(self._broadcast_payload(source), source)
        self._has_state = True
        if self._reshard_state(held, mine) or received:
            self.save()
        self._reshard()
        self.verify_same_state(source)
        return source

    def _reshard_state(self, held: Any, commits: int) -> bool:
        """`optimizer_state.reshard`; where shards were lost (any sharding stage), the whole
        state from the last sharded ``checkpoint`` instead: the commit count, sampler and
        values go back to its commit, as a replay from there would (collective: every rank
        learns of the loss alike); True if sharded."""
        try:
            return optimizer_state.reshard(self.optimizer, held, commits)
        except ShardsLostError as lost:
            reached = self.commits
            if self._checkpoint is None:
                raise
            agree_on_checkpoint(self._checkpoint, lost)
            if not self.load_checkpoint():
                raise ShardsLostError(f"{lost} (no checkpoint in {self._checkpoint} yet)") from None
            _log.warning(
                "%s; took the sharded checkpoint in %s: commit %d, %d step(s) trained again",
                str(lost).partition(". ")[0],
                self._checkpoint,
                self.commits,
                reached - self.commits,
            )
            return False  # load_checkpoint saved the snapshot

    def digest(self) -> list[int]:
        """A 64-bit hash of each part of `DIGEST_PARTS` of this rank's state, bit for bit.

        Buffers (e.g. BatchNorm statistics, which are not synchronised every step) and your
        own values are left out: they may differ between ranks.
        """
        params: Any = (
            [(n, p) for n, p in self.model.named_parameters()] if self.model is not None else []
        )
        full = optimizer_state.fully_sharded(self.optimizer)
        if full is not None:  # shards differ by design: their names, shapes and dtypes
            params = [[n, str(tuple(p.shape)), str(p.dtype)] for n, p in params]
        optimizer = (
            [optimizer_state.digested(self.optimizer), self._loss_scale()]
            if self.optimizer is not None
            else None
        )
        sampler = self.sampler.state_dict() if self.sampler is not None else None
        return [hash_tree(part) for part in (self.commits, params, optimizer, sampler)]

    def verify_same_state(self, source: int = 0) -> None:
        """Collective: raise `StateMismatchError` on every rank when any rank's `digest`
        differs from rank ``source``'s; the message names those ranks and the parts that
        differ. One all-gather of a few integers per rank."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return
        device = control_device()
        mine = torch.tensor(self.digest(), dtype=torch.long, device=device)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        digests = [[int(v) for v in t.tolist()] for t in gathered]
        reference = digests[source]
        differ = {
            rank: [part for part, a, b in zip(DIGEST_PARTS, d, reference, strict=True) if a != b]
            for rank, d in enumerate(digests)
            if d != reference
        }
        if not differ:
            _log.info("state digests agree on all %d ranks", len(digests))
            return
        ranks = sorted(differ)
        detail = "; ".join(f"rank {r}: {', '.join(differ[r])}" for r in ranks)
        raise StateMismatchError(
            f"after the state sync the state of rank{'s' if len(ranks) > 1 else ''} "
            f"{', '.join(map(str, ranks))} differs from rank {source}'s, whose state every rank "
            f"should hold ({detail}); training on would silently diverge"
        )

    def _broadcast_payload(self, source: int) -> bytes | None:
        device = control_device()
        payload = torch.empty(0, dtype=torch.uint8, device=device)
        if dist.get_rank() == source:
            buffer = io.BytesIO()
            torch.save(self._payload(), buffer)
            data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
            payload = data.to(device)
        size = torch.tensor([payload.numel()], device=device)
        dist.broadcast(size, source)
        if dist.get_rank() != source:
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        dist.broadcast(payload, source)
        return None if dist.get_rank() == source else payload.cpu().numpy().tobytes()

    def _payload(self) -> dict[str, Any]:
        return {
            "commits": self.commits,
            "model": self.model.state_dict() if self._whole_model() else None,
            "optimizer": (
                optimizer_state.payload(self.optimizer) if self.optimizer is not None else None
            ),
            "sampler": self.sampler.state_dict() if self.sampler is not None else None,
            "values": self._values,
            "loss_scale": self._loss_scale(),
        }

    def _receive(self, data: bytes | None, source: int) -> None:
        if data is not None:
            self._load(torch.load(io.BytesIO(data), weights_only=True))
            _log.info("took the state of rank %d (%d commits)", source, self.commits)

    def _load(self, payload: dict[str, Any]) -> None:
        self.commits = int(payload["commits"])
        if self.model is not None and payload["model"] is not None:
            self.model.load_state_dict(payload["model"])
        if self.optimizer is not None and payload["optimizer"] is not None:
            optimizer_state.load_payload(self.optimizer, payload["optimizer"])
        if self.sampler is not None and payload["sampler"] is not None:
            self.sampler.load_state_dict(payload["sampler"])
        object.__setattr__(self, "_values", dict(payload["values"]))
        self._set_loss_scale(payload.get("loss_scale"))  # absent from older checkpoints

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
        elif optimizer_state.fully_sharded(self.optimizer) is not None:
            from longboat.sharding.elastic import rebuild as rebuild_sharded

            rebuild_sharded(self.model, self.optimizer)  # type: ignore[arg-type]
        for callback in self._resets:
            callback()

    def recovering_since(self, began: float) -> None:
        """Report, at the next commit, how long recovery from a failure at ``began`` took."""
        self._recovering = began

    # -- disk --------------------------------------------------------------------------------

    def write_checkpoint(self) -> None:
        """Rank 0 writes the state to ``checkpoint`` (temporary file, then rename); with a
        sharded optimizer every rank takes part, and ``checkpoint`` is the directory of a
        sharded checkpoint (`longboat.sharding.zero.files`)."""
        if self._checkpoint is None:
            return
        if optimizer_state.is_sharded(self.optimizer):
            from longboat.sharding.checkpoint import save_sharded_checkpoint

            assert self.optimizer is not None
            save_sharded_checkpoint(self._checkpoint, self.optimizer, self._payload())
            return
        if cluster.rank() != 0:
            return
        self._checkpoint.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._checkpoint.with_name(f".{self._checkpoint.name}.writing")
        torch.save(self._payload(), tmp)
        os.replace(tmp, self._checkpoint)

    def load_checkpoint(self) -> bool:
        """Load ``checkpoint`` if it exists (e.g. when the whole job restarts); True if loaded.
        A sharded optimizer loads the slices this rank owns, at any world size."""
        if self._checkpoint is None:
            return False
        if optimizer_state.is_sharded(self.optimizer):
            from longboat.sharding.checkpoint import load_sharded_checkpoint

            assert self.optimizer is not None
            payload = load_sharded_checkpoint(self._checkpoint, self.optimizer)
        elif self._checkpoint.exists():
            payload = torch.load(self._checkpoint, weights_only=True)
        else:
            payload = None
        if payload is None:
            return False
        self._load(payload)
        self._has_state = True
        self.save()
        return True


def _check_model(model: nn.Module | None, optimizer: torch.optim.Optimizer | None) -> None:
    from longboat.collective.model import DistributedModel
    from longboat.collective.rebuild import check_rebuildable

    if isinstance(model, DistributedModel):
        check_rebuildable(model)
    stage3 = sys.modules.get("longboat.sharding.model")
    full = stage3 is not None and isinstance(model, stage3.FullyShardedModel)
    if full and optimizer_state.fully_sharded(optimizer) is None:
        raise ValueError(
            "lb.elastic.State(model=...) of a sharding stage 3 model needs the optimizer "
            "lb.distribute returned with it too (optimizer=...): it holds the parameters' shards"
        )
