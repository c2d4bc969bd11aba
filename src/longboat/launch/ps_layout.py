"""The job-wide parameter-server layout of a multi-node job, gathered at start-up.

Each node runs its own ``--servers S --workers W``; every rank publishes its role and
endpoint through the rendezvous store, and every rank computes the same layout: every server
of the job first (by node rank, then local index), then every trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

#: store keys of the layout: one prefix for the whole job, so that a node whose agent restarts
#: its ranks (a different attempt number than the other nodes) finds the same keys again
PREFIX = "/longboat-launch/ps"
SERVERS_KEY = "servers"


@dataclass(frozen=True)
class Layout:
    """Every server endpoint, every trainer endpoint, and where this rank stands."""

    servers: list[str]
    trainers: list[str]
    role: str
    index: int

    @property
    def endpoints(self) -> list[str]:
        return self.servers + self.trainers

    @property
    def rank(self) -> int:
        """This rank's position in the layout (servers first)."""
        return self.index if self.role == "server" else len(self.servers) + self.index


class LayoutError(RuntimeError):
    """The nodes of the job do not add up to a parameter-server job."""


def local_role(local_rank: int, local_servers: int) -> str:
    """A node starts its servers first: local ranks below ``local_servers`` serve."""
    return "server" if local_rank < local_servers else "trainer"


def gather(store: Any, rank: int, world: int, role: str, endpoint: str, timeout: float) -> Layout:
    """Publish ``role endpoint`` for torch rank ``rank``; wait (bounded) for every rank's."""
    store.set(f"role/{rank}", f"{role} {endpoint}")
    keys = [f"role/{r}" for r in range(world)]
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except Exception:  # torch raises its own DistStoreError on timeout
        missing = [r for r in range(world) if not store.check([f"role/{r}"])]
        raise TimeoutError(
            f"waited {timeout:.0f}s for the parameter-server roles of ranks {missing} (of "
            f"{world}); did every node start `longboat launch` with --servers/--workers?"
        ) from None
    entries = [store.get(k).decode().split(" ", 1) for k in keys]
    return build(entries, rank)


def build(entries: list[list[str]], rank: int) -> Layout:
    """The layout from ``[role, endpoint]`` per torch rank (torch numbers node by node)."""
    servers = [ep for r, ep in entries if r == "server"]
    trainers = [ep for r, ep in entries if r == "trainer"]
    if not servers or not trainers:
        missing = "server" if not servers else "trainer"
        raise LayoutError(
            f"the job has {len(servers)} servers and {len(trainers)} trainers over all nodes: "
            f"no {missing}; give some node --{'servers' if not servers else 'workers'} N >= 1"
        )
    role = entries[rank][0]
    index = sum(1 for r in range(rank) if entries[r][0] == role)
    return Layout(servers, trainers, role, index)
