"""``hvd.elastic``: Horovod's elastic API on ``lb.elastic``.

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.batch += 1
            state.commit()

    state = hvd.elastic.TorchState(model, optimizer, batch=0, epoch=0)
    train(state)

Start it with ``longboat launch --nnodes MIN:MAX`` (see docs/elastic.md). What maps to what:

* ``run`` is ``lb.elastic.run``; after a membership change it also makes the facade anew for
  the new world: ``hvd.init()`` (negotiation thread and groups) and ``rebuild()`` of every
  live ``hvd.DistributedOptimizer`` (its reducer's hooks move to the new process group),
  before the reset callbacks. A peer failure or a ``HorovodInternalError`` rolls back to the
  last commit (``restore``); a ``HostsUpdatedInterrupt`` keeps the state, as in Horovod.
* ``TorchState``/``ObjectState`` are ``lb.elastic.State``: ``commit`` (save, then
  ``check_host_updates``), ``restore``, ``save``, ``sync``, ``register_reset_callbacks``;
  values are attributes. ``sync`` always sends the state of the rank with the most commits
  (rank 0 when all are equal) to every other rank, so, as in Horovod, the first call makes the
  ranks agree without ``hvd.broadcast_parameters``. Values must be tensors, numbers, strings
  or lists/dicts of those (not arbitrary pickled objects).
* ``ElasticSampler`` is ``lb.elastic.ElasticSampler``, a *batch* sampler: see its docstring.

A rank that joins late replays the script up to ``train(state)``: keep only ``hvd.init()``,
building the model and the ``hvd.DistributedOptimizer`` there (no ``hvd.broadcast_*``; the
first ``sync`` does that job), or the joiner waits on collectives the others never make.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sized
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from longboat.comm.exchange import control_device
from longboat.elastic import world
from longboat.elastic.failures import describe, is_peer_failure
from longboat.elastic.run import run as _lb_run
from longboat.elastic.sampler import ElasticSampler as _LbSampler
from longboat.elastic.state import State as _LbState
from longboat.horovod.torch import basics, process_sets
from longboat.horovod.torch.optimizer import live_optimizers
from longboat.horovod.torch.requests import HorovodInternalError
from longboat.log import get_logger

__all__ = [
    "ElasticSampler",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "ObjectState",
    "State",
    "TorchState",
    "run",
]

_log = get_logger("longboat.horovod")
T = TypeVar("T")


class HostsUpdatedInterrupt(world.MembershipChanged):
    """Horovod's name for a membership change seen at ``commit``/``check_host_updates``
    (a ``lb.elastic.MembershipChanged``): the state is kept, not rolled back."""

    skip_sync = False


class _CollectiveFailed(dist.DistError):
    """A ``HorovodInternalError`` handed to ``lb.elastic.run`` as the peer failure it means."""


# -- run ----------------------------------------------------------------------------------------


def _drop_controller() -> None:
    """Stop the negotiation thread without ``hvd.shutdown``'s barrier (a peer is gone)."""
    ctl = basics._forget()
    if ctl is not None:
        process_sets.close_all()  # their groups span the old world too
        ctl.close(grace_s=1.0)


def run(func: Callable[..., T]) -> Callable[..., T]:
    """Horovod's ``@hvd.elastic.run``: call ``func(state, ...)`` again after every membership
    change, with the facade rebuilt for the new world (see the module docstring)."""

    @functools.wraps(func)
    def attempt(state: _LbState, *args: Any, **kwargs: Any) -> T:
        if not world.is_elastic():
            return func(state, *args, **kwargs)
        try:
            return func(state, *args, **kwargs)
        except world.MembershipChanged:
            raise
        except HorovodInternalError as exc:
            _drop_controller()
            if is_peer_failure(exc):
                raise
            raise _CollectiveFailed(describe(exc)) from exc
        except Exception as exc:
            if is_peer_failure(exc):
                _drop_controller()
            raise

    return _lb_run(attempt)


def _rebuild_facade() -> None:
    """The new world is formed: negotiation and every DistributedOptimizer's reducer anew."""
    basics.init()
    optimizers = live_optimizers()
    for optimizer in optimizers:
        optimizer.rebuild()
    _log.info(
        "rank %d of %d: hvd rebuilt with %d DistributedOptimizer(s)",
        basics.rank(),
        basics.size(),
        len(optimizers),
    )


# -- state --------------------------------------------------------------------------------------


class State(_LbState):
    """Horovod's ``hvd.elastic.State`` on ``lb.elastic.State`` (``check_host_updates``,
    ``HostsUpdatedInterrupt``, the facade rebuilt on reset, ``sync`` always sending)."""

    def check_membership(self) -> None:
        """Collective: raise ``HostsUpdatedInterrupt`` if a node joined or left."""
        try:
            super().check_membership()
        except HostsUpdatedInterrupt:
            raise
        except world.MembershipChanged as exc:
            raise HostsUpdatedInterrupt(str(exc)) from exc

    def check_host_updates(self) -> None:
        """Horovod's name for :meth:`check_membership`."""
        self.check_membership()

    def on_reset(self) -> None:
        """After a new world formed: ``hvd.init()``, rebuild the optimizers, then callbacks."""
        _rebuild_facade()
        super().on_reset()

    def sync(self) -> int:
        """Collective: every rank takes the state of the rank with the most commits (the
        lowest such rank); returns it. Unlike ``lb.elastic.State.sync`` it is sent even when
        the counts agree, as Horovod's sync broadcasts from rank 0."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return super().sync()
        device = control_device()  # the GPU under NCCL, which has no CPU collectives
        counts = [
            torch.zeros(1, dtype=torch.long, device=device) for _ in range(dist.get_world_size())
        ]
        dist.all_gather(counts, torch.tensor([self.commits], device=device))
        values = [int(c.item()) for c in counts]
        source = values.index(max(values))
        self._receive(self._broadcast_payload(source), source)
        self._has_state = True
        self._reshard()
        self.verify_same_state(source)  # every rank's digest, as lb.elastic.State.sync does
        return source


class ObjectState(State):
    """Horovod's ``ObjectState(bcast_object=None, get_rank=None, **kwargs)``: plain values.

    ``bcast_object`` and ``get_rank`` are accepted and not used: ``sync`` sends the values
    with longboat's state broadcast (tensors, numbers, strings, lists/dicts of those).
    """

    def __init__(
        self,
        bcast_object: Callable[[Any], Any] | None = None,
        get_rank: Callable[[], int] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)


class TorchState(State):
    """Horovod's ``TorchState(model=None, optimizer=None, **kwargs)``.

    Keeps one module, one optimizer and at most one :class:`ElasticSampler` (under any keyword,
    e.g. ``train_sampler=sampler``; ``state.train_sampler`` is that sampler); other keywords
    are values. Several modules or optimizers: put them in an ``nn.ModuleDict`` or give each
    its own state.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **kwargs: Any,
    ) -> None:
        samplers = {k: v for k, v in kwargs.items() if isinstance(v, _LbSampler)}
        wrong = [
            k
            for k, v in kwargs.items()
            if isinstance(v, nn.Module | torch.optim.Optimizer | torch.utils.data.Sampler)
            and k not in samplers
        ]
        if wrong or len(samplers) > 1:
            raise ValueError(
                f"TorchState keeps one model, one optimizer and one hvd.elastic.ElasticSampler; "
                f"got more in {sorted(wrong) or sorted(samplers)} (put several modules in an "
                "nn.ModuleDict, or give each its own state)"
            )
        values = {k: v for k, v in kwargs.items() if k not in samplers}
        sampler = next(iter(samplers.values()), None)
        super().__init__(model, optimizer, sampler, **values)
        for name in samplers:  # Horovod's attribute name for it
            object.__setattr__(self, name, sampler)


# -- sampler ------------------------------------------------------------------------------------


class ElasticSampler(_LbSampler):
    """Horovod's ``ElasticSampler(dataset, shuffle=True, seed=0)`` as longboat's batch sampler.

    longboat lays out whole global steps (every rank's batch of each step) so that progress
    survives a change of world size exactly; that needs the per-rank batch size, so:

    * construct it with ``batch_size=B`` and give it to the loader as
      ``DataLoader(dataset, batch_sampler=sampler)`` (not ``sampler=`` with ``batch_size=``);
    * ``record_batch(batch_idx, batch_size)``: records one global step; ``batch_idx`` must be
      the loader's batch index since the epoch (re)started on this world (``enumerate``'s),
      ``batch_size`` the sampler's;
    * ``record_indices(indices)``: accepted when they are this rank's next batch (then it is
      ``record_batch``); any other set cannot be recorded, ValueError;
    * ``set_epoch(e)``: a new epoch starts afresh; the same epoch again keeps its progress
      (Horovod would clear it);
    * ``state_dict()`` is longboat's (a processed mask); ``load_state_dict`` also takes
      Horovod's ``{"epoch", "processed_indices"}``; ``processed_indices`` is a property;
    * ``len(sampler)`` counts this rank's batches left (Horovod: samples), and there is no
      padding: no sample is repeated.
    """

    def __init__(
        self,
        dataset: Sized | int,
        shuffle: bool = True,
        seed: int = 0,
        *,
        batch_size: int | None = None,
    ) -> None:
        if batch_size is None:
            raise TypeError(
                "hvd.elastic.ElasticSampler needs the per-rank batch size on longboat: "
                "ElasticSampler(dataset, batch_size=B), used as "
                "DataLoader(dataset, batch_sampler=sampler)"
            )
        super().__init__(dataset, batch_size, shuffle=shuffle, seed=seed)

    @property
    def processed_indices(self) -> set[int]:  # type: ignore[override]  # Horovod's attribute
        """Indices processed so far this epoch, by every rank."""
        return set(super().processed_indices())

    def record_batch(self, batch_idx: int = -1, batch_size: int | None = None) -> None:
        """Horovod's ``record_batch(batch_idx, batch_size)``: one global step is done."""
        if batch_size is not None and batch_size != self.batch_size:
            raise ValueError(
                f"record_batch(batch_size={batch_size}) but the sampler's batch size is "
                f"{self.batch_size}"
            )
        if batch_idx >= 0 and batch_idx != self._steps:
            raise ValueError(
                f"record_batch(batch_idx={batch_idx}) but the next batch since the loader "
                f"started on this world is {self._steps}: call it once per batch, with "
                "enumerate(loader)'s index"
            )
        super().record_batch()

    def record_indices(self, indices: Iterable[int]) -> None:
        """Record this rank's next batch, given as its indices (as the loader yielded them)."""
        steps, _ = self._current_plan()
        given = sorted(int(i) for i in indices)
        mine = sorted(steps[self._steps][self.rank]) if self._steps < len(steps) else None
        if given != mine:
            raise ValueError(
                "record_indices: longboat records whole global steps, so the indices must be "
                f"this rank's next batch {mine}; got {given}. Use record_batch(batch_idx, "
                "batch_size) after each batch"
            )
        super().record_batch()

    def reset(self) -> None:
        """Lay out what is left of the epoch over the current ``hvd.rank()``/``hvd.size()``."""
        self.reshard(basics.rank(), basics.size())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """longboat's state, or Horovod's ``{"epoch": e, "processed_indices": set}``."""
        if "processed" not in state and "processed_indices" in state:
            mask = torch.zeros(self.num_samples, dtype=torch.bool)
            done = sorted(int(i) for i in state["processed_indices"])
            if done:
                mask[torch.tensor(done, dtype=torch.long)] = True
            state = {
                "epoch": int(state["epoch"]),
                "seed": self.seed,
                "shuffle": self.shuffle,
                "batch_size": self.batch_size,
                "num_samples": self.num_samples,
                "processed": mask,
                "steps": 0,
            }
        super().load_state_dict(state)
