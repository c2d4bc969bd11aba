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

import inspect
from collections.abc import Callable, Mapping
from typing import Any, Protocol

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


def make(
    name: str, group: dist.ProcessGroup, options: Mapping[str, Any] | None = None
) -> AllreduceFn:
    """Build algorithm ``name`` for ``group`` (collective: every rank, in the same order).

    ``options``: the plan's algorithm settings (``CommPlan.options``, e.g. ``inter_nranks``);
    each goes to a factory that takes it by name, and a factory taking ``**options`` (one that
    builds others, like ``auto``) gets them all to pass on.
    """
    factory = ALGORITHMS.get(name)
    return factory(group, **_taken_by(factory, options or {}))


def _taken_by(factory: Callable[..., Any], options: Mapping[str, Any]) -> dict[str, Any]:
    params = inspect.signature(factory).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return dict(options)
    names = {p.name for p in params if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
    return {key: value for key, value in options.items() if key in names}


class Done:
    """A handle for work that already finished (e.g. an allreduce over one rank)."""

    def wait(self) -> bool:
        return True
