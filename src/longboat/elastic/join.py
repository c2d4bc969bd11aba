"""How a rank of an elastic job joins its round: the startup `longboat.init` hands the cluster.

The launcher publishes each round's membership in ``LONGBOAT_ELASTIC_DIR``; a rank takes its
place from the latest one (its environment may be rounds old), connects to the round's
namespace of the store, and once its process group formed acknowledges the round to its
launcher and starts watching for nodes the next round drops (`longboat.elastic.lost_links`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta

import torch.distributed as dist

from longboat.cluster.info import ClusterError, ClusterInfo
from longboat.cluster.startup import Startup
from longboat.elastic.lost_links import socket_inodes, watch_lost_nodes
from longboat.elastic.membership import (
    connect_store,
    elastic_dir,
    read_membership,
    require_elastic_dir,
    write_ack,
)
from longboat.elastic.world import survivor


def place_in_round(found: ClusterInfo) -> ClusterInfo:
    """In an elastic job, this rank's place in the round its launcher published last; else
    ``found`` unchanged."""
    directory = elastic_dir()
    if directory is None:
        return found
    membership = read_membership(directory)
    if membership is None:
        raise ClusterError(
            f"LONGBOAT_ELASTIC_DIR={directory} has no membership yet: elastic ranks are "
            "started by `longboat launch --nnodes MIN:MAX`"
        )
    rank = membership.rank_of(found.local_rank)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(membership.world_size),
        GROUP_RANK=str(membership.group_rank),
        GROUP_WORLD_SIZE=str(membership.group_world_size),
        LONGBOAT_NODE_RANK=str(membership.group_rank),
        LONGBOAT_NNODES=str(membership.group_world_size),
    )
    return replace(
        found,
        rank=rank,
        world_size=membership.world_size,
        node_rank=membership.group_rank,
        num_nodes=membership.group_world_size,
        node_key=f"node:{membership.group_rank}",
        elastic_round=membership,
        carries_state=survivor(),
    )


def round_store(info: ClusterInfo, timeout: timedelta) -> dist.Store | None:
    """The round's namespace of the launcher's store, or None outside an elastic round."""
    if info.elastic_round is None:
        return None
    return connect_store(info.elastic_round, timeout)


def joining(info: ClusterInfo) -> Callable[[], None] | None:
    """Before the group forms: note the sockets already open; after: acknowledge the round
    to the launcher and watch for lost nodes. None outside an elastic round."""
    membership = info.elastic_round
    if membership is None:
        return None
    opened_before = set(socket_inodes())

    def joined() -> None:
        directory = require_elastic_dir()
        write_ack(directory, info.local_rank, membership.token)  # this rank made it
        watch_lost_nodes(membership, directory, opened_before)

    return joined


def startup() -> Startup:
    """The round-joining part of ``lb.init``'s startup (placement, store, acknowledgement)."""
    return Startup(place=place_in_round, store=round_store, joining=joining)
