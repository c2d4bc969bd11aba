"""What the running world says about itself, read by every entry point that builds or rebuilds
a model's collectives (the engine, the elastic rebuilds, sharding stage 3, the integrations)."""

from __future__ import annotations

import torch.distributed as dist

import longboat.cluster as cluster
from longboat.collective.plan import Placement
from longboat.comm.exchange import any_rank


def live_placement() -> Placement:
    """Where this job's ranks run: the cluster's node of every rank, and its backend."""
    return Placement.of(cluster.topology().node_of, str(dist.get_backend()))


def state_carried_over() -> bool:
    """Collective in an elastic round: does any rank keep training state from an earlier
    round (``ClusterInfo.carries_state``)? Then ``State.sync`` hands it to everyone, and
    broadcasting rank 0's fresh parameters first would only cost time."""
    info = cluster.cluster()
    return info.elastic_round is not None and any_rank(info.carries_state)
