"""What the layers above the process group hand `longboat.cluster.init`: no import runs up.

The cluster package knows how to discover a rank, form the process group and measure the
topology. Elastic rounds, the stall inspector and the cluster line's allreduce choice live in
higher layers; ``longboat.init`` (`longboat.session`) gathers them into a :class:`Startup` and
passes it down. ``longboat.cluster.init`` without one starts a plain process group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from longboat.cluster.info import ClusterInfo
from longboat.cluster.topology import Topology


@dataclass(frozen=True, kw_only=True, slots=True)
class Startup:
    """Callbacks around the start of the process group; every one is optional."""

    place: Callable[[ClusterInfo], ClusterInfo] | None = None
    """This rank's place, refined from what the environment says (an elastic round's ranks)."""
    store: Callable[[ClusterInfo, timedelta], dist.Store | None] | None = None
    """The rendezvous store to use instead of the environment's (None: the environment's)."""
    joining: Callable[[ClusterInfo], Callable[[], None] | None] | None = None
    """Called just before the group forms; returns what to call once it has (or None)."""
    started: Callable[[ClusterInfo, Topology, Any], None] | None = None
    """Called once ``init`` is done, with the strategy it was given (watches start here)."""
    describe: Callable[[ClusterInfo, Topology, Any], str] | None = None
    """The end of the cluster line rank 0 logs (e.g. ``, allreduce: shm (one node, CPU)``)."""
    waiting: Callable[[str, float], contextlib.AbstractContextManager[Any]] | None = None
    """A context naming a wait for the stall inspector (``barrier`` uses it)."""

    def named_wait(self, what: str, timeout_s: float) -> contextlib.AbstractContextManager[Any]:
        """``waiting(what, timeout_s)``, or a context that does nothing."""
        if self.waiting is None:
            return contextlib.nullcontext()
        return self.waiting(what, timeout_s)
