"""Who am I in the cluster: discovery from launcher environments, process-group lifecycle, topology.

import longboat.cluster as lc
info = lc.init()            # reads torchrun/Paddle/Horovod/Slurm/Open MPI variables
lc.topology().local_ranks() # ranks that share my node
lc.shutdown()
"""

from longboat.cluster.env import derived_port, discover
from longboat.cluster.hostlist import expand_hostlist, expand_tasks_per_node
from longboat.cluster.info import ClusterError, ClusterInfo
from longboat.cluster.runtime import (
    DEFAULT_TIMEOUT_S,
    barrier,
    cluster,
    current_strategy,
    init,
    is_initialized,
    job_timeout,
    local_rank,
    local_world_size,
    new_group,
    node_rank,
    num_nodes,
    on_group_end,
    on_shutdown,
    rank,
    shutdown,
    topology,
    world_size,
)
from longboat.cluster.topology import Topology

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ClusterError",
    "ClusterInfo",
    "Topology",
    "barrier",
    "cluster",
    "current_strategy",
    "derived_port",
    "discover",
    "expand_hostlist",
    "expand_tasks_per_node",
    "init",
    "is_initialized",
    "job_timeout",
    "local_rank",
    "local_world_size",
    "new_group",
    "node_rank",
    "num_nodes",
    "on_group_end",
    "on_shutdown",
    "rank",
    "shutdown",
    "topology",
    "world_size",
]
