"""The description of one process's place in the cluster, and the error for a bad environment."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Source = Literal["torch", "paddle", "horovod", "slurm", "openmpi", "single"]


class ClusterError(RuntimeError):
    """The environment does not describe a usable cluster, or the process group failed to form."""


@dataclass(frozen=True)
class ClusterInfo:
    """Who this process is: global/local/node ranks, the rendezvous point and where it came from.

    ``node_key`` is the node identity the environment gave explicitly (``"node:3"``,
    ``"ip:10.0.0.2"``), or None when only the hostname can tell nodes apart.
    ``backend`` is None until :func:`longboat.cluster.init` fills it.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    source: Source
    backend: str | None = None
    node_key: str | None = None
    elastic_round: Any = None  # longboat.elastic.membership.Membership in an elastic job
    carries_state: bool = False
    """This process keeps training state from an earlier round of its elastic job."""

    def describe(self) -> str:
        """One human-readable line, e.g. for the startup log."""
        return (
            f"rank {self.rank}/{self.world_size} (local {self.local_rank}/{self.local_world_size}, "
            f"node {self.node_rank}/{self.num_nodes}) via {self.source}, "
            f"backend={self.backend or '-'}, master={self.master_addr}:{self.master_port}"
        )
