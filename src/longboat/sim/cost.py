"""Alpha-beta cost of one collective, per algorithm, as (latency, bandwidth) seconds.

A collective of S bytes over n ranks (M nodes of L ranks) costs ``steps * alpha`` of latency
(not shared between concurrent collectives) plus ``bytes / rate`` of link time (shared by the
collectives in flight at the same moment, see `longboat.sim.timeline`):

* ``ring``: ``2 (n-1)`` steps, ``2 (n-1)/n * S`` bytes on the slowest link of the ring;
* ``native``: the backend's allreduce, modelled as halving-doubling / tree: ``2 ceil(log2 n)``
  steps, the ring's ``2 (n-1)/n * S`` bytes;
* ``hierarchical``: intra-node reduce-scatter, ``native`` inter-node allreduce of S/L bytes on
  each of L groups sharing the node's NICs, intra-node all-gather. With ``shm``/``loopback``
  intra links (CPU) each intra stage is a shared-memory allreduce, as longboat runs it;
* ``shm`` (one node): ``shm_passes * S * L`` bytes through the memory bandwidth.

Across nodes the ring's link is ``min(intra rate, inter rate * min(NICs, L))`` (one ring per
NIC). Calibrated per-algorithm corrections add a fixed overhead per call and scale bandwidth;
so do the calibrated corrections of the backend's own all-gather and reduce-scatter
(`all_gather_tensor`, `reduce_scatter_tensor`: FSDP2's collectives at sharding stage 3).

These alpha-beta rules are the Gloo backend's (CPU ranks, calibrated by `longboat sim
calibrate`). With NCCL (GPU devices) ``native`` and ``ring`` follow NCCL's own cost model
(`longboat.sim.nccl`: message-size dependent, ring or tree, LL/LL128/Simple), and
``hierarchical``'s stages are NCCL reduce-scatter, allreduce and all-gather.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from longboat.comm.algorithms import Parts
from longboat.registry import ALGORITHMS, auto_candidates
from longboat.sim import nccl
from longboat.sim.cluster import Cluster


class CostError(ValueError):
    """An algorithm that does not apply to the cluster."""


def _log2(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def ring(nbytes: float, n: int, alpha: float, rate: float) -> Parts:
    """Ring allreduce of ``nbytes`` over ``n`` ranks on one kind of link."""
    if n <= 1:
        return 0.0, 0.0
    return 2 * (n - 1) * alpha, 2 * (n - 1) / n * nbytes / rate


def tree(nbytes: float, n: int, alpha: float, rate: float) -> Parts:
    """The backend's allreduce: ``2 ceil(log2 n)`` latency steps, ring bandwidth."""
    if n <= 1:
        return 0.0, 0.0
    return 2 * _log2(n) * alpha, 2 * (n - 1) / n * nbytes / rate


def half_ring(nbytes: float, n: int, alpha: float, rate: float) -> Parts:
    """Reduce-scatter or all-gather: half of a ring allreduce."""
    lat, bw = ring(nbytes, n, alpha, rate)
    return lat / 2, bw / 2


def shm(nbytes: float, local: int, cluster: Cluster) -> Parts:
    """Shared-memory allreduce among ``local`` ranks of one node."""
    if local <= 1:
        return 0.0, 0.0
    return 0.0, cluster.shm_passes * nbytes * local / cluster.mem_bw


def _arch(cluster: Cluster) -> str:
    return cluster.spec.arch if cluster.is_gpu else "ampere"


def _intra_bus(cluster: Cluster) -> float:
    link = cluster.node_link
    return nccl.intra_rate(link.kind, link.rate, _arch(cluster))


def _nic(cluster: Cluster) -> float:
    """Bytes/s NCCL reaches on one of the node's NICs."""
    return nccl.nic_rate(cluster.inter.rate, cluster.inter.gpudirect, cluster.pcie_bandwidth)


def _hop(cluster: Cluster) -> str:
    return "nvlink" if cluster.node_link.kind in ("nvlink", "nvswitch") else "pcie"


def fabric(cluster: Cluster) -> nccl.Fabric:
    """The NCCL communicator over every rank of ``cluster``."""
    intra = _intra_bus(cluster)
    if cluster.nodes == 1:
        bus, channels = intra, nccl.channels_for(intra, cluster.node_link.links)
    else:
        nics = min(cluster.inter.nics_per_node, cluster.devices_per_node)
        net = nics * _nic(cluster)
        bus, channels = min(intra, net), 2 * nics
    return nccl.Fabric(cluster.world, cluster.nodes, bus, channels, _hop(cluster), _arch(cluster))


def bus_limit(cluster: Cluster) -> tuple[float, str]:
    """NCCL's bus bytes/s per rank over the whole cluster and the link that bounds it."""
    bus = fabric(cluster).bus_bw
    if cluster.nodes > 1 and bus < _intra_bus(cluster):
        nics = min(cluster.inter.nics_per_node, cluster.devices_per_node)
        return bus, f"{nics} NIC(s) per node" + (
            "" if cluster.inter.gpudirect else ", no GPUDirect"
        )
    link = cluster.node_link
    if cluster.intra.kind == "nvlink" and link.kind == "pcie":
        return bus, f"PCIe between NVLink groups of {cluster.intra.group}"
    return bus, link.kind


def uses_nccl(cluster: Cluster) -> bool:
    return cluster.resolved_backend() == "nccl"


def flat_link(cluster: Cluster) -> tuple[float, float]:
    """(alpha, rate) of a collective over every rank of the cluster."""
    link = cluster.node_link
    if uses_nccl(cluster):
        alpha = link.latency if cluster.nodes == 1 else cluster.inter.latency
        return alpha, fabric(cluster).bus_bw
    if cluster.nodes == 1:
        return link.latency, link.rate
    nics = min(cluster.inter.nics_per_node, cluster.devices_per_node)
    rate = min(link.rate, cluster.inter.rate * nics)
    return max(link.latency, cluster.inter.latency), rate


def _intra_stage(nbytes: float, cluster: Cluster) -> Parts:
    local, link = cluster.devices_per_node, cluster.node_link
    if link.kind in ("shm", "loopback"):
        return shm(nbytes, local, cluster)
    return half_ring(nbytes, local, link.latency, link.rate)


def _nccl_allreduce(nbytes: float, cluster: Cluster, algorithm: str) -> Parts:
    """NCCL's cost; ``hierarchical`` as longboat runs it on NCCL communicators."""
    local, nodes = cluster.devices_per_node, cluster.nodes
    if algorithm == "hierarchical" and nodes > 1 and local > 1:
        arch, intra = _arch(cluster), _intra_bus(cluster)
        node = nccl.Fabric(local, 1, intra, nccl.channels_for(intra, cluster.node_link.links),
                           _hop(cluster), arch)  # fmt: skip
        nics = min(cluster.inter.nics_per_node, local)
        per_group = nics * _nic(cluster) / local
        across = nccl.Fabric(nodes, nodes, per_group, 2, _hop(cluster), arch)
        stage = nccl.half_ring(nbytes, node)
        inter = nccl.allreduce(nbytes / local, across)
        return 2 * stage[0] + inter[0], 2 * stage[1] + inter[1]
    return nccl.allreduce(nbytes, fabric(cluster), "ring" if algorithm == "ring" else None)


class ClusterNetwork:
    """``cluster`` as the algorithms' cost models read it (`longboat.comm.algorithms.Network`):
    the primitives above, on its links."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.world, self.local, self.nodes = cluster.world, cluster.devices_per_node, cluster.nodes
        self.on_device = uses_nccl(cluster)
        self.host_shared_memory = cluster.intra.kind in ("shm", "loopback")

    def nccl(self, nbytes: float, algorithm: str | None) -> Parts:
        return _nccl_allreduce(nbytes, self.cluster, algorithm or "native")

    def flat(self, nbytes: float, shape: str) -> Parts:
        alpha, rate = flat_link(self.cluster)
        return (ring if shape == "ring" else tree)(nbytes, self.world, alpha, rate)

    def shm(self, nbytes: float) -> Parts:
        return shm(nbytes, self.local, self.cluster)

    def node_allreduce(self, nbytes: float) -> Parts:
        link = self.cluster.node_link
        if link.kind in ("shm", "loopback"):
            return shm(nbytes, self.local, self.cluster)
        return ring(nbytes, self.local, link.latency, link.rate)

    def node_half(self, nbytes: float) -> Parts:
        return _intra_stage(nbytes, self.cluster)

    def across_nodes(self, nbytes: float) -> Parts:
        inter = self.cluster.inter
        share = min(inter.nics_per_node, self.local) / self.local
        return tree(nbytes, self.nodes, inter.latency, inter.rate * share)


def _model(algorithm: str) -> Callable[[float, ClusterNetwork], Parts | None]:
    """The cost model ``algorithm`` registered with (`longboat.registry.ALGORITHMS`)."""
    model = ALGORITHMS.entry(algorithm).cost  # names the registered choices if unknown
    if model is None:
        raise CostError(
            f"allreduce algorithm {algorithm!r} declares no cost model, so longboat sim cannot "
            "predict it; register it with cost=... (docs/algorithms.md)"
        )
    return model


def applicable(algorithm: str, cluster: Cluster) -> bool:
    """Whether ``algorithm`` has a cost model that applies to ``cluster``."""
    entry = ALGORITHMS.entry(algorithm) if algorithm in ALGORITHMS else None
    if entry is None or entry.cost is None:
        return False
    return entry.cost(1.0, ClusterNetwork(cluster)) is not None


def allreduce(nbytes: float, cluster: Cluster, algorithm: str = "native") -> Parts:
    """(latency, link) seconds of one allreduce of ``nbytes`` over the whole cluster."""
    if cluster.world <= 1 or nbytes <= 0:
        return 0.0, 0.0
    parts = _model(algorithm)(nbytes, ClusterNetwork(cluster))
    if parts is None:
        raise CostError(
            f"allreduce algorithm {algorithm!r} does not apply to {cluster.nodes} node(s)"
        )
    lat, bw = parts
    cost = cluster.cost(algorithm)
    return lat + cost.overhead, bw / cost.bandwidth_efficiency


def allgather(nbytes_per_rank: float, cluster: Cluster) -> Parts:
    """(latency, link) seconds of an all-gather of ``nbytes_per_rank`` from every rank."""
    n = cluster.world
    if n <= 1:
        return 0.0, 0.0
    alpha, rate = flat_link(cluster)
    return (n - 1) * alpha, (n - 1) * nbytes_per_rank / rate


def corrected(parts: Parts, cluster: Cluster, name: str) -> Parts:
    """``parts`` of one of the backend's own collectives (`COLLECTIVES`: ``all_gather``,
    ``reduce_scatter``) with the cluster's calibrated correction of it (none: unchanged)."""
    lat, bw = parts
    correction = cluster.collective_cost(name)
    return lat + correction.overhead, bw / correction.bandwidth_efficiency


def all_gather_tensor(nbytes_per_rank: float, cluster: Cluster) -> Parts:
    """The backend's own all-gather into one tensor (``all_gather_into_tensor``, as FSDP2
    issues it): `allgather` with the cluster's calibrated ``all_gather`` correction."""
    if cluster.world <= 1 or nbytes_per_rank <= 0:
        return 0.0, 0.0
    return corrected(allgather(nbytes_per_rank, cluster), cluster, "all_gather")


def reduce_scatter_tensor(nbytes: float, cluster: Cluster) -> Parts:
    """The backend's own reduce-scatter of ``nbytes`` (the whole tensor; ``reduce_scatter_tensor``,
    as FSDP2 issues it): half its allreduce, with the cluster's calibrated ``reduce_scatter``
    correction (Gloo's costs more than half its allreduce on CPU ranks)."""
    if cluster.world <= 1 or nbytes <= 0:
        return 0.0, 0.0
    lat, bw = allreduce(nbytes, cluster)
    return corrected((lat / 2, bw / 2), cluster, "reduce_scatter")


def candidates(cluster: Cluster) -> list[str]:
    """The algorithms ``allreduce_algorithm='auto'`` would try on ``cluster``
    (`longboat.registry.auto_candidates`, in its order) that have a cost model applying to it."""
    return [
        e.name
        for e in auto_candidates(cluster.world, cluster.nodes)
        if e.cost is not None and applicable(e.name, cluster)
    ]


def best_algorithm(nbytes: float, cluster: Cluster) -> str:
    """What ``allreduce_algorithm='auto'`` would pick: the cheapest of its candidates."""
    return min(candidates(cluster), key=lambda a: sum(allreduce(nbytes, cluster, a)))
