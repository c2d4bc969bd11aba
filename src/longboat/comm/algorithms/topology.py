"""topology: the default; picks an algorithm from where the group's ranks run, without a trial.

Shared memory (``shm``) when every rank is on one node, ``hierarchical`` (shm inside each node,
native across) when several nodes hold several ranks each, the backend's own (``native``) on
NCCL and with one rank per node: the rule of
:func:`longboat.cluster.topology.comm_defaults`, which ``docs/algorithms.md`` explains.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from longboat.cluster.topology import CommDefaults, comm_defaults
from longboat.comm.algorithms import AllreduceFn, make, register


def group_defaults(group: dist.ProcessGroup) -> CommDefaults:
    """The topology rule for ``group`` (placement from the cluster's node keys; no collective)."""
    import longboat.cluster as cluster

    topo = cluster.topology()
    ranks = dist.get_process_group_ranks(group)
    return comm_defaults(
        [topo.node_of[r] for r in ranks],
        str(dist.get_backend(group)),
        spans_world=len(ranks) == dist.get_world_size(),
    )


@register("topology", tune=False)
def make_topology(group: dist.ProcessGroup, **options: Any) -> AllreduceFn:
    """By topology: shm on one node, hierarchical across nodes of several ranks, else native.

    ``options``: the plan's, for the one chosen."""
    return make(group_defaults(group).algorithm, group, options)
