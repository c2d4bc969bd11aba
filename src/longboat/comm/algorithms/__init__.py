"""Allreduce algorithms, registered by name and selected by the Strategy.

An algorithm is a small module with its state and one entry point: a factory
``make(group) -> AllreduceFn`` where ``AllreduceFn(tensor) -> Handle`` starts an in-place
SUM allreduce of ``tensor`` over ``group`` and returns a handle whose ``wait()`` blocks until
the result is in ``tensor``. The reducer only ever sees ``AllreduceFn``; adding an algorithm
means adding a module and one ``register`` call (its declaration: which topologies the
automatic choice may try it on, whether the start-up broadcast goes through it), never
touching the reducer or the Strategy; see ``docs/algorithms.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from longboat.registry import ALGORITHMS


class Handle(Protocol):
    """An in-flight collective: ``wait()`` blocks until its result is ready."""

    def wait(self) -> object: ...


AllreduceFn = Callable[[torch.Tensor], Handle]
AlgorithmFactory = Callable[[dist.ProcessGroup], AllreduceFn]


register = ALGORITHMS.register  # decorator: selectable as Strategy.allreduce_algorithm = name
names = ALGORITHMS.names


def make(name: str, group: dist.ProcessGroup) -> AllreduceFn:
    """Build algorithm ``name`` for ``group`` (collective: every rank, in the same order)."""
    return ALGORITHMS.get(name)(group)


class Done:
    """A handle for work that already finished (e.g. an allreduce over one rank)."""

    def wait(self) -> bool:
        return True
