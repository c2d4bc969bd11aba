"""Which ranks share a node, learned by all-gathering a fixed-size node key (no pickling), and
the communication defaults that follow from it."""

from __future__ import annotations

import socket
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from longboat.cluster.backends import runs_on_device

#: Bytes per node key on the wire: 2 for the length, the rest for the UTF-8 text.
KEY_BYTES = 258


@dataclass(frozen=True)
class Topology:
    """The node of every global rank. Node indices follow the order of first appearance."""

    node_of: tuple[int, ...]
    rank: int = 0

    @property
    def nodes(self) -> int:
        """Number of distinct nodes."""
        return max(self.node_of) + 1

    @property
    def node(self) -> int:
        """This rank's node index."""
        return self.node_of[self.rank]

    @property
    def is_homogeneous(self) -> bool:
        """True when every node runs the same number of ranks."""
        return len({len(self.ranks_on_node(n)) for n in range(self.nodes)}) == 1

    def ranks_on_node(self, node: int) -> list[int]:
        """Global ranks on node ``node``, ascending."""
        if not 0 <= node < self.nodes:
            raise ValueError(f"node {node} out of range: the cluster has {self.nodes} nodes")
        return [r for r, n in enumerate(self.node_of) if n == node]

    def local_ranks(self) -> list[int]:
        """Global ranks on this rank's node, ascending."""
        return self.ranks_on_node(self.node)

    def leaders(self) -> list[int]:
        """The lowest global rank of each node, in node order."""
        return [self.ranks_on_node(n)[0] for n in range(self.nodes)]

    @classmethod
    def from_keys(cls, keys: list[str], rank: int) -> Topology:
        """Number nodes by first appearance of their key."""
        index: dict[str, int] = {}
        return cls(tuple(index.setdefault(k, len(index)) for k in keys), rank)


def node_key(explicit: str | None) -> str:
    """The key that identifies this process's node: the environment's, else the hostname."""
    return explicit if explicit is not None else f"host:{socket.gethostname()}"


def encode_key(key: str) -> torch.Tensor:
    """Pack ``key`` into a uint8 tensor of KEY_BYTES bytes: big-endian length, text, zeros."""
    data = key.encode()
    if len(data) > KEY_BYTES - 2:
        raise ValueError(f"node key {key!r} is longer than {KEY_BYTES - 2} bytes")
    out = torch.zeros(KEY_BYTES, dtype=torch.uint8)
    out[0], out[1] = len(data) >> 8, len(data) & 0xFF
    out[2 : 2 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def decode_key(packed: torch.Tensor) -> str:
    """Inverse of encode_key; rejects a malformed length instead of reading past it."""
    raw = bytes(packed.cpu().tolist())
    length = (raw[0] << 8) | raw[1]
    if length > KEY_BYTES - 2:
        raise ValueError(f"malformed node key: length {length} > {KEY_BYTES - 2}")
    return raw[2 : 2 + length].decode(errors="replace")


def gather_topology(
    key: str, device: torch.device, group: dist.ProcessGroup | None = None
) -> Topology:
    """All-gather every rank's node key over ``group`` (collective: every rank must call it)."""
    mine = encode_key(key).to(device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return Topology.from_keys([decode_key(t) for t in gathered], dist.get_rank(group))


@dataclass(frozen=True)
class CommDefaults:
    """What ``allreduce_algorithm='topology'`` and the topology-derived bucket size and
    communicator count resolve to on one placement of ranks (see ``docs/algorithms.md``)."""

    algorithm: str
    reason: str
    fuse_grad_size_in_MB: float
    nccl_comm_num: int

    def describe(self) -> str:
        """E.g. ``shm (one node, CPU)``."""
        return f"{self.algorithm} ({self.reason})"


#: Bucket size (MB) and communicator count on one node, and across several nodes.
ONE_NODE_FUSE_MB, ONE_NODE_COMMS = 32.0, 1
MULTI_NODE_FUSE_MB, MULTI_NODE_COMMS = 2.0, 2


def comm_defaults(node_of: Sequence[int], backend: str, spans_world: bool = True) -> CommDefaults:
    """The topology rule, for a group whose rank ``i`` runs on node ``node_of[i]``.

    Algorithm: the backend's own (``native``) on NCCL, on one rank and with one rank per
    node; shared memory (``shm``) when every rank is on one node; ``hierarchical`` (shared
    memory inside each node, native across) when several nodes hold the same number of
    several ranks each and the group spans the world (it creates sub-groups). Buckets and
    communicators: large buckets on one communicator, except across nodes on CPU (Gloo): small
    buckets on two communicators, so more of the slow link's transfer overlaps backward (NCCL
    keeps Fleet's 32 MB on one communicator: not measured here).
    ``spans_world``: the group is the whole world.
    """
    counts = Counter(node_of)
    ranks, nodes, per_node = len(node_of), len(counts), sorted(set(counts.values()))
    if nodes > 1 and not runs_on_device(backend):
        fuse, comms = MULTI_NODE_FUSE_MB, MULTI_NODE_COMMS
    else:
        fuse, comms = ONE_NODE_FUSE_MB, ONE_NODE_COMMS
    if ranks == 1:
        algorithm, reason = "native", "one rank"
    elif runs_on_device(backend):
        algorithm, reason = "native", "NCCL"
    elif nodes == 1:
        algorithm, reason = "shm", "one node, CPU"
    elif ranks == nodes:
        algorithm, reason = "native", "one rank per node"
    elif len(per_node) == 1 and spans_world:
        algorithm, reason = "hierarchical", f"{nodes} nodes x {per_node[0]} ranks, CPU"
    else:
        algorithm, reason = "native", f"{nodes} nodes, unequal ranks per node"
    return CommDefaults(algorithm, reason, fuse, comms)
