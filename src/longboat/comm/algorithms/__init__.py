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
Parts = tuple[float, float]  # (latency seconds, link seconds) of one collective


class Network(Protocol):
    """The simulated cluster as an algorithm's cost model sees it (``register(cost=...)``).

    ``longboat sim`` passes one (`longboat.sim.cost.ClusterNetwork`); each method returns the
    ``(latency_s, link_s)`` of one collective of ``nbytes``. A cost model combines them the way
    its algorithm moves data, and returns None where the algorithm does not apply.
    """

    world: int  # ranks
    local: int  # ranks per node
    nodes: int
    on_device: bool  # GPU ranks over NCCL
    host_shared_memory: bool  # the ranks of a node share host memory

    def nccl(self, nbytes: float, algorithm: str | None) -> Parts:
        """NCCL's allreduce: ``"ring"``, ``"hierarchical"`` (intra, inter, intra), else NCCL's
        own choice."""
        ...

    def flat(self, nbytes: float, shape: str) -> Parts:
        """A ``"ring"`` or ``"tree"`` allreduce over every rank, at the slowest hop's speed."""
        ...

    def shm(self, nbytes: float) -> Parts:
        """An allreduce of one node's ranks through shared memory."""
        ...

    def node_allreduce(self, nbytes: float) -> Parts:
        """An allreduce inside one node over its own link (shared memory or a ring)."""
        ...

    def node_half(self, nbytes: float) -> Parts:
        """Half an allreduce inside a node (a reduce-scatter, or an all-gather)."""
        ...

    def across_nodes(self, nbytes: float) -> Parts:
        """A tree allreduce across nodes, each rank with its share of the node's NICs."""
        ...


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
