"""`LaunchSpec`: everything `longboat launch` needs, validated from its options
(`longboat.launch.options.spec_from_args`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LaunchSpec:
    """Everything the launcher needs, validated."""

    target: str  # a script path, or a module name with module=True
    target_args: list[str]
    module: bool = False
    nproc_per_node: int = 1
    devices: list[str] = field(default_factory=list)
    nnodes: int = 1  # elastic: the most nodes (MAX of --nnodes MIN:MAX)
    node_rank: int = 0  # elastic: unknown before the rendezvous (0)
    min_nodes: int | None = None  # elastic jobs only (--nnodes MIN:MAX)
    failure_timeout: float | None = None
    master_host: str | None = None
    master_port: int | None = None
    ips: list[str] = field(default_factory=list)
    log_dir: str = "log"
    max_restarts: int = 0
    config: str | None = None
    tee_all: bool = False
    servers: int = 0
    workers: int = 0
    ports: list[int] = field(default_factory=list)  # this node's ranks' ports, when listed
    timeout: float = 300.0
    ps_checkpoint_dir: str | None = None  # parameter-server checkpoints (absolute path)

    @property
    def ps(self) -> bool:
        """Parameter-server mode: ``--servers``/``--workers`` given for this node."""
        return bool(self.servers or self.workers)

    @property
    def multinode_ps(self) -> bool:
        """Parameter-server roles spread over several nodes (job-wide layout gathered at start)."""
        return self.ps and self.nnodes > 1

    @property
    def local_procs(self) -> int:
        """Processes this node starts (PS: this node's servers + workers)."""
        return self.servers + self.workers if self.ps else self.nproc_per_node

    @property
    def elastic(self) -> bool:
        """``--nnodes MIN:MAX``: ranks survive nodes leaving and joining."""
        return self.min_nodes is not None

    @property
    def world_size(self) -> int:
        return self.local_procs * self.nnodes


class LaunchOptionError(ValueError):
    """A launch option is wrong; the message names it and the fix."""
