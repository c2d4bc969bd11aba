"""``lb.init``: join the cluster with what the layers above the process group need started.

`longboat.cluster.init` forms the process group and knows nothing above it; this hands it
the elastic round's placement and store (`longboat.elastic.join`), the stall inspector's
watch of collectives (`longboat.trace.stall`) and the cluster line's allreduce choice (the
strategy resolved on the measured placement, `longboat.collective.plan`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from longboat.cluster import ClusterInfo, Topology
from longboat.cluster import init as start_group
from longboat.cluster.startup import Startup

if TYPE_CHECKING:
    from longboat.strategy import Strategy


def init(
    strategy: Strategy | None = None, backend: str | None = None, timeout: float | None = None
) -> ClusterInfo:
    """Join the cluster described by the environment (torchrun, Paddle, Horovod, Slurm, Open
    MPI or ``longboat launch`` variables); returns this process's ClusterInfo.

    Idempotent: later calls return the first call's info (a non-None ``strategy`` replaces
    the stored one). ``backend``: argument, else LONGBOAT_BACKEND, else "nccl" with CUDA and
    "gloo" without. ``timeout`` (seconds): argument, else LONGBOAT_TIMEOUT, else 300; bounds
    the rendezvous and every collective of the job.
    """
    from longboat.cluster import is_initialized
    from longboat.elastic import world

    def begin() -> ClusterInfo:
        return start_group(strategy, backend, timeout, startup=startup())

    if world.is_elastic() and not is_initialized():
        return world.join(begin)  # a round replaced while it forms is joined again
    return begin()


def startup() -> Startup:
    """The callbacks `longboat.cluster.init` runs around the process group's start."""
    from longboat.elastic import join
    from longboat.trace.config import TraceConfig
    from longboat.trace.stall import waiting, watch_collectives

    return replace(
        join.startup(),
        started=lambda info, topo, strategy: watch_collectives(
            TraceConfig.of(_strategy_or_default(strategy))
        ),
        describe=_allreduce_choice,
        waiting=lambda what, timeout_s: waiting(what, timeout_s=timeout_s),
    )


def _strategy_or_default(strategy: Any) -> Strategy:
    """``strategy``, or the defaults when none (or a foreign object) was given."""
    from longboat.strategy import Strategy

    return strategy if isinstance(strategy, Strategy) else Strategy()


def _allreduce_choice(info: ClusterInfo, topo: Topology, strategy: Any) -> str:
    """``, allreduce: <choice>`` of the collective strategy on this placement, else ''."""
    from longboat.collective.plan import Placement, resolve_comm

    strategy = _strategy_or_default(strategy)
    if strategy.mode != "collective":
        return ""
    placement = Placement.of(topo.node_of, str(info.backend))
    from longboat.sharding.config import ShardingPlan
    from longboat.sharding.policies import banner

    per_node = info.world_size // max(1, topo.nodes)
    sharding = banner(ShardingPlan.of(strategy), info.world_size, per_node, topo.nodes)
    return f", allreduce: {resolve_comm(strategy, placement).describe()}{sharding}"
