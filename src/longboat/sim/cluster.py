"""The simulated cluster: nodes, devices, links, input pipeline, parameter servers; read from
YAML or flags.

A cluster file (every key optional except ``nodes`` and ``devices_per_node``)::

    nodes: 4
    devices_per_node: 8
    device: V100                 # cpu | profiled | V100 | A100 | H100 | L40S ... | {name: ...}
    backend: auto                # auto (nccl on GPUs, gloo on cpu) | nccl | gloo
    intra: {kind: nvlink, links: 6, link_bandwidth: 25GB/s, latency: 3us}
    # bridged pairs on a PCIe server: intra: {kind: nvlink, links: 12, group: 2}
    inter: {bandwidth: 100Gb/s, latency: 5us, nics_per_node: 4, gpudirect: true}
    compute: {efficiency: 0.5, precision: fp32, jitter: 0.01, device_spread: 0.011,
              contention: 0.1}
    input: {samples_per_s: 20000}  # per node, measured; default: never the bottleneck
    # or: input: {workers: 64, worker_samples_per_s: 130}  # loader processes on a node
    memory_bandwidth: 900GB/s    # default: the device's
    ps: {servers: 4, bandwidth: 25Gb/s, latency: 20us}
    algorithms: {ring: {bandwidth_efficiency: 0.8, overhead: 50us}}
    collectives: {reduce_scatter: {bandwidth_efficiency: 0.3, overhead: 200us}}  # and all_gather
    fsdp2: {step_overhead: 1ms, unit_overhead: 2ms, param_overhead: 50us}  # sharding stage 3
"""

from __future__ import annotations

from pathlib import Path

import yaml

from longboat.sim.cluster_read import default_intra, from_dict
from longboat.sim.cluster_types import (
    BACKENDS,
    COLLECTIVES,
    DEFAULT_WORKER_RATE,
    GPU_LINKS,
    HOST_DEVICES,
    INTRA_KINDS,
    PCIE_LATENCY,
    AlgorithmCost,
    Cluster,
    ClusterError,
    Fsdp2Cost,
    Link,
    PsServers,
)

__all__ = [
    "BACKENDS",
    "COLLECTIVES",
    "DEFAULT_WORKER_RATE",
    "GPU_LINKS",
    "HOST_DEVICES",
    "INTRA_KINDS",
    "PCIE_LATENCY",
    "AlgorithmCost",
    "Cluster",
    "ClusterError",
    "Fsdp2Cost",
    "Link",
    "PsServers",
    "default_intra",
    "from_dict",
    "load",
    "save",
]


def load(path: str | Path) -> Cluster:
    """Read a cluster YAML (or JSON) file."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ClusterError(f"cluster file {str(path)!r} does not exist") from None
    except yaml.YAMLError as exc:
        raise ClusterError(f"{path}: not valid YAML: {exc}") from None
    if data is None:
        raise ClusterError(f"{path}: empty; needs at least nodes and devices_per_node")
    return from_dict(data, where=str(path))


def save(cluster: Cluster, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cluster.to_dict(), sort_keys=False))
