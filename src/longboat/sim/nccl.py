"""NCCL's allreduce cost: message-size dependent, ring or tree, LL / LL128 / Simple protocol.

NCCL itself picks, per call, the algorithm and protocol with the lowest predicted time
``latency + bytes / algorithm bandwidth`` from a model of its own (NVIDIA/nccl,
``src/graph/tuning.cc`` and ``src/graph/topo.h``; the constants below are that model's, read at
commit 5067397c2676d5aed50042fc39e5c8ee96eb0027). This module evaluates the same kind of model
on the simulated fabric, so small buckets are latency-bound (LL: low latency, half the
bandwidth), large ones bandwidth-bound (Simple), and across nodes the tree's logarithmic latency
competes with the ring's linear one:

* bus bandwidth: one node: the device's intra-node link (NVLink ports x 20 GB/s, NCCL's own
  figure for a 25 GB/s port; PCIe 12 GB/s for Gen3 x16); across nodes the smaller of that and
  the node's NICs the job's local ranks can use (NCCL's 12 GB/s per 100 Gbit/s), halved per NIC
  without GPUDirect RDMA (the data crosses the host's PCIe link in and out);
* ring: ``2 (n-1)`` steps, algorithm bandwidth ``bus * n / (2 (n-1))``; latency
  ``base + intra steps * intra hop + 2 (nodes-1) * network hop``;
* tree (allreduce): algorithm bandwidth ``bus * 0.92 / 2`` (capped per channel); latency
  ``base + 2 ((ppn-1) intra hop + log2(nodes) network hop)``;
* protocols: LL at half the bus bandwidth (capped), LL128 at 92 % (capped per channel), Simple
  at all of it, each with its own base and per-hop latencies.

Simplifications: NCCL's per-size tree correction table, NVLS/CollNet/PAT and CPU-vendor
specific LL caps (the Intel figures are used) are left out; channel counts are the NVLink ports
(one node) or two per NIC (across nodes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PROTOCOLS = ("LL", "LL128", "Simple")
ALGORITHMS = ("ring", "tree")

# microseconds, (LL, LL128, Simple)
BASE_LATENCY = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4)}
HOP_LATENCY = {
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4)},
    "pcie": {"tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7)},
    "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0)},
}
NET_OVERHEAD_US = 1.0  # per inter-node ring step on x86 Intel hosts (x3 with Simple)
# GB/s, indexed by nodes: (1, 2, more)
LL_MAX_BW = {
    "volta": (39.0, 39.0, 20.4),
    "ampere": (87.7, 39.0, 20.4),
    "hopper": (141.0, 39.0, 20.4),
    "blackwell": (282.0, 39.0, 20.4),
}
PER_CHANNEL_RING_LL128 = {"volta": 20.0, "ampere": 20.0, "hopper": 36.7, "blackwell": 40.0}
PER_CHANNEL_TREE_LL128 = {
    "volta": (20.0, 20.0, 20.0),
    "ampere": (20.0, 20.0, 20.0),
    "hopper": (36.7, 36.7, 29.0),
    "blackwell": (55.6, 31.67, 20.0),
}
PER_CHANNEL_TREE = {
    "volta": (26.5, 18.5, 10.0),
    "ampere": (24.0, 23.6, 17.8),
    "hopper": (38.7, 41.4, 36.0),
    "blackwell": (70.0, 42.8, 24.0),
}
RING_PLATEAU = {"volta": 1.9, "ampere": 1.4, "hopper": 1.4, "blackwell": 1.4}

#: NCCL's bandwidth figures against the vendors' (topo.h): per NVLink port 20 of 25 GB/s (20.6
#: on Hopper), PCIe Gen3 x16 12 of 15.75 GB/s, 12 GB/s per 100 Gbit/s (12.5 GB/s) NIC.
NVLINK_SHARE = {"volta": 0.8, "ampere": 0.8, "hopper": 20.6 / 25, "blackwell": 40.1 / 50}
PCIE_SHARE = 12.0 / 15.75
NET_SHARE = 12.0 / 12.5
CHANNEL_GBPS = 20.0  # a channel's bandwidth when the ports are not described


@dataclass(frozen=True)
class Fabric:
    """What an NCCL communicator sees: ranks, nodes, bus bandwidth (bytes/s), channels, the
    intra-node hop kind (nvlink or pcie) and the device architecture."""

    ranks: int
    nodes: int
    bus_bw: float
    channels: int
    intra_hop: str = "nvlink"
    arch: str = "ampere"


def _index(nodes: int) -> int:
    return min(nodes, 3) - 1


def _bus(fabric: Fabric, algorithm: str, protocol: int) -> float:
    """Bus bandwidth in GB/s of one algorithm and protocol (NCCL's refinements)."""
    bus = fabric.bus_bw / 1e9
    ch, arch, i = fabric.channels, fabric.arch, _index(fabric.nodes)
    ll_max = LL_MAX_BW[arch][i]
    if algorithm == "ring":
        if protocol == 0:
            return min(ll_max, bus * 0.5)
        if protocol == 1:
            return min(bus * 0.92, ch * PER_CHANNEL_RING_LL128[arch])
        return bus
    bus = min(bus * 0.92, ch * PER_CHANNEL_TREE[arch][i])
    if protocol == 0:
        return min(bus / 3.8, ll_max)
    if protocol == 1:
        factor = 7.0 / 9.0 if fabric.nodes == 1 else 120.0 / 128.0
        return min(bus * factor, ch * PER_CHANNEL_TREE_LL128[arch][i])
    return bus


def _latency_us(fabric: Fabric, algorithm: str, protocol: int, nbytes: float) -> float:
    n, nodes = fabric.ranks, fabric.nodes
    ppn = n // nodes
    intra = HOP_LATENCY[fabric.intra_hop][algorithm][protocol]
    net = HOP_LATENCY["net"]["tree" if ppn == 1 else algorithm][protocol]
    lat = BASE_LATENCY[algorithm][protocol]
    if algorithm == "tree":
        return lat + 2 * ((ppn - 1) * intra + math.floor(math.log2(nodes)) * net)
    if nodes > 1:
        intra = max(intra, NET_OVERHEAD_US * (3 if protocol == 2 else 1))
    steps, inter_steps = 2 * (n - 1), 2 * (nodes - 1)
    lat += (steps - inter_steps) * intra + inter_steps * net
    if protocol == 2 and nodes > 1 and nbytes / (fabric.channels * n) >= 64:
        lat *= RING_PLATEAU[fabric.arch]
    return lat


def options(nbytes: float, fabric: Fabric) -> dict[tuple[str, str], tuple[float, float]]:
    """(latency s, transfer s) of every algorithm and protocol for an allreduce."""
    n = fabric.ranks
    out = {}
    for algorithm in ALGORITHMS:
        for p, name in enumerate(PROTOCOLS):
            bus = _bus(fabric, algorithm, p)
            if bus <= 0:
                continue
            algbw = bus * (n / (2 * (n - 1)) if algorithm == "ring" else 0.5)
            out[(algorithm, name)] = (
                _latency_us(fabric, algorithm, p, nbytes) * 1e-6,
                nbytes / (algbw * 1e9),
            )
    return out


def allreduce(nbytes: float, fabric: Fabric, algorithm: str | None = None) -> tuple[float, float]:
    """(latency, transfer) seconds NCCL's choice takes (``algorithm`` restricts it to ring or
    tree); nothing for one rank or no bytes."""
    if fabric.ranks <= 1 or nbytes <= 0:
        return 0.0, 0.0
    choices = options(nbytes, fabric)
    if algorithm is not None:
        choices = {k: v for k, v in choices.items() if k[0] == algorithm}
    return min(choices.values(), key=sum)


def choice(nbytes: float, fabric: Fabric) -> tuple[str, str]:
    """The (algorithm, protocol) NCCL's model picks for ``nbytes``."""
    choices = options(nbytes, fabric)
    return min(choices, key=lambda k: sum(choices[k]))


def half_ring(nbytes: float, fabric: Fabric) -> tuple[float, float]:
    """Reduce-scatter or all-gather (ring): ``n-1`` steps, ``(n-1)/n`` of the bytes."""
    n = fabric.ranks
    if n <= 1 or nbytes <= 0:
        return 0.0, 0.0
    best = None
    for p in range(len(PROTOCOLS)):
        bus = _bus(fabric, "ring", p)
        lat = BASE_LATENCY["ring"][p] + (n - 1) * HOP_LATENCY[fabric.intra_hop]["ring"][p]
        parts = (lat * 1e-6, (n - 1) / n * nbytes / (bus * 1e9))
        if best is None or sum(parts) < sum(best):
            best = parts
    assert best is not None
    return best


def intra_rate(kind: str, bandwidth: float, arch: str) -> float:
    """Bus bytes/s NCCL reaches on a device's intra-node link of ``bandwidth`` (vendor)."""
    if kind in ("nvlink", "nvswitch"):
        return bandwidth * NVLINK_SHARE.get(arch, 0.8)
    if kind == "pcie":
        return bandwidth * PCIE_SHARE
    return bandwidth


def nic_rate(bandwidth: float, gpudirect: bool, pcie: float = 15.75e9) -> float:
    """Bytes/s NCCL reaches on one NIC; without GPUDirect RDMA each byte crosses the device's
    PCIe link (``pcie`` bytes/s, Gen3 x16 by default) twice, device to host memory and host
    memory to NIC, so a NIC gets at most half of what NCCL reaches on that link."""
    rate = bandwidth * NET_SHARE
    return rate if gpudirect else min(rate, pcie * PCIE_SHARE / 2)


def channels_for(bus_bw: float, links: float) -> int:
    """Channels: the NVLink ports when described, else one per 20 GB/s of bus bandwidth."""
    if links:
        return max(1, round(links))
    return max(1, round(bus_bw / (CHANNEL_GBPS * 1e9)))
