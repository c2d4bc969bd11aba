"""Parameter-server modes, registered by name and selected by ``PSConfig.mode``.

A mode is a `Mode` subclass: class attributes tell the engine what the servers do with a
push; ``step()`` runs one optimizer step of a trainer with what `ModeContext` gives it (the
dense parameters' pushes and pulls, the sparse tables' lookups, the step number); ``cost``
prices a step for ``longboat sim`` from an `Exchange` (what waits, how many pushes and pulls).
Adding a mode means adding a module with one ``@register(name)`` class (a built-in one: a file
in this folder), never touching the engine; the Strategy selects it with
``a_sync_configs={"mode": name}``::

    from longboat.ps.trainer.modes import Mode, register, wait_all

    @register("eager_sync")
    class EagerSync(Mode):
        sync = True

        def step(self) -> None:
            params, step = self.ctx.params, self.ctx.step()
            wait_all(params.push_grads(range(len(params)), step))
            wait_all(self.ctx.sparse.push(step, every_server=True))
            params.pull(step + 1)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from longboat.ps.trainer.config import PSConfig
from longboat.ps.trainer.params import DenseParams, wait_all
from longboat.ps.trainer.sparse import SparseLookups
from longboat.registry import PS_MODES, Registry

__all__ = ["Exchange", "Mode", "ModeContext", "StepCost", "get", "names", "register", "wait_all"]


@dataclass(frozen=True)
class Exchange:
    """One trainer step of a parameter-server job as ``longboat sim`` sees it: the parts a
    mode's ``cost`` combines (seconds)."""

    compute: float  # forward + backward
    optimizer: float  # the trainer's own optimizer step
    update: float  # the servers' update of one step's pushes from every trainer
    transfer: float  # one direction of the dense exchange: the slower of trainer and server links
    own: float  # one direction of the dense exchange over this trainer's own link
    servers: float  # one direction of every trainer's dense traffic over the servers' links
    latency: float  # one server-link latency (an RPC waits for two: request, reply)
    k_steps: int  # the Strategy's a_sync_configs["k_steps"]


@dataclass(frozen=True)
class StepCost:
    """A mode's predicted step (seconds): its length, the communication not hidden, the
    optimizer's part, all communication, and the mode as a prediction names it."""

    step: float
    exposed: float
    optimizer: float
    comm: float
    label: str


@dataclass(frozen=True)
class ModeContext:
    """What a mode's step works with (built by the engine once the servers are initialised)."""

    cfg: PSConfig
    params: DenseParams  # pushes and pulls of the dense parameters, pulls in flight, barrier
    sparse: SparseLookups  # lookups of the SparseEmbedding tables and pushes of their rows
    optimizer: torch.optim.Optimizer  # the trainer's own (geo, update_on_server=False)
    trainers: int
    step: Callable[[], int]  # the step being taken (0 first; the engine counts)
    waiting: Callable[[str], contextlib.AbstractContextManager[Any]]  # a blocking wait
    local_step: Callable[[], None]  # the trainer's optimizer step (on the timeline)


class Mode:
    """One mode's trainer step; subclass, set the class attributes, implement ``step``.

    ``update`` is how servers apply a push to a dense block ("optimizer": the trainer's
    optimizer runs there on the pushed gradient; "delta": the value moves by the push);
    ``sync``: servers combine every trainer's push of a step and pulls (and sparse lookups)
    wait for that step's result; ``trainer_optimizer``: ``update_on_server=False`` is allowed;
    ``uses_k_steps``: ``k_steps`` is part of the trainers' agreement; ``recoverable``: after a
    server restarts from its periodic checkpoint, a trainer can replay the steps since then
    (every push of a step is combined on the servers, so the replay is exact); ``cost``: its
    step for ``longboat sim`` from an `Exchange` (None: the simulator refuses the mode).
    """

    update: ClassVar[str] = "optimizer"
    sync: ClassVar[bool] = False
    trainer_optimizer: ClassVar[bool] = False
    uses_k_steps: ClassVar[bool] = False
    recoverable: ClassVar[bool] = False
    cost: ClassVar[Callable[[Exchange], StepCost] | None] = None

    def __init__(self, ctx: ModeContext) -> None:
        self.ctx = ctx

    def step(self) -> None:
        """One optimizer step (the engine waits for its pulls in flight first)."""
        raise NotImplementedError

    def flush(self) -> None:
        """Send everything queued (before ``refresh`` pulls, and at ``close``)."""

    def abandon(self) -> None:
        """Drop pushes in flight (``restore`` after a server restart)."""

    def close(self) -> None:
        """Stop background work (after ``flush``)."""


# the built-in modes: every module of this folder (a new one is one file here, nothing else);
# the registry lives in longboat.registry, where the Strategy reads the names without this
_MODES: Registry[type[Mode]] = PS_MODES
register = _MODES.register  # class decorator: selectable as PSConfig.mode = name
names = _MODES.names
get = _MODES.get
unregister = _MODES.unregister  # tests remove what they registered
