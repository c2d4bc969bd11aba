"""The simulated cluster's types: links, algorithm costs, parameter servers and the cluster
itself, with the figures derived from them (the file format: `longboat.sim.cluster`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from longboat.sim import devices
from longboat.sim.devices import Device
from longboat.sim.units import rate_text

INTRA_KINDS = ("nvlink", "nvswitch", "pcie", "shm", "loopback")
GPU_LINKS = ("nvlink", "nvswitch", "pcie")
BACKENDS = ("auto", "nccl", "gloo")
HOST_DEVICES = ("cpu", "profiled")
PCIE_LATENCY = 5e-6  # one-way, per message


class ClusterError(ValueError):
    """A cluster description that cannot be used, with the key and what is allowed."""


@dataclass(frozen=True)
class Link:
    """One link: bytes/s per direction, one-way latency per message, payload efficiency.

    Intra-node links are per device (NVLink: ``links`` ports of the device, joining the
    devices of a domain of ``group``, 0: the whole node; between domains ``pcie`` bytes/s, 0:
    the device's PCIe link); inter-node links are per NIC, ``nics_per_node`` of them, with or
    without GPUDirect RDMA."""

    bandwidth: float
    latency: float
    kind: str = "net"
    nics_per_node: int = 1
    efficiency: float = 1.0
    links: float = 0.0  # NVLink ports in use per device (0: not described)
    gpudirect: bool = True
    group: int = 0  # NVLink: devices one NVLink domain joins (0: the whole node)
    pcie: float = 0.0  # NVLink: bytes/s between domains (0: the device's PCIe link)

    @property
    def rate(self) -> float:
        """Payload bytes/s (``bandwidth * efficiency``)."""
        return self.bandwidth * self.efficiency

    def among(self, n: int, per: int, pcie: float) -> Link:
        """The link a collective over ``n`` of a node's ``per`` devices uses. Directly wired
        NVLink (``nvlink``): only the ports among those devices, a device's ports taken as
        spread evenly over the peers of its domain; a collective wider than one domain
        crosses PCIe between domains (``pcie``, or this link's own figure), which bounds its
        ring. Other kinds are the same for any part of the node."""
        if self.kind != "nvlink":
            return self
        domain = min(self.group or per, per)
        if n > domain:
            return Link(self.pcie or pcie, PCIE_LATENCY, "pcie", efficiency=self.efficiency)
        share = max(n - 1, 1) / (domain - 1) if domain > 1 else 1.0
        return dataclasses.replace(
            self, bandwidth=self.bandwidth * share, links=self.links * share, group=0
        )


@dataclass(frozen=True)
class AlgorithmCost:
    """Calibrated corrections of one algorithm: bandwidth multiplier and fixed cost per call."""

    bandwidth_efficiency: float = 1.0
    overhead: float = 0.0


#: the collectives `Cluster.collectives` corrects, against the alpha-beta rule (`sim.cost`)
COLLECTIVES = ("all_gather", "reduce_scatter")


@dataclass(frozen=True)
class Fsdp2Cost:
    """FSDP2's host work per training step beyond its collectives' link time and copies
    (`longboat sim calibrate` measures it on CPU ranks): a fixed part, a part per unit
    (``fully_shard`` call holding parameters), per parameter tensor and per byte its
    collectives move (their buffers' allocation, beyond the copies through memory)."""

    step_overhead: float = 0.0
    unit_overhead: float = 0.0
    param_overhead: float = 0.0
    byte_overhead: float = 0.0

    def seconds(self, units: int, params: int, nbytes: float) -> float:
        """One step's host work for ``units`` units holding ``params`` parameter tensors whose
        collectives move ``nbytes``."""
        if units == 0:
            return 0.0
        return (
            self.step_overhead
            + units * self.unit_overhead
            + params * self.param_overhead
            + nbytes * self.byte_overhead
        )


@dataclass(frozen=True)
class PsServers:
    servers: int
    link: Link


@dataclass(frozen=True)
class Cluster:
    nodes: int
    devices_per_node: int
    device: str = "cpu"
    intra: Link = field(default_factory=lambda: Link(300e9, 3e-6, "nvswitch", links=12))
    inter: Link = field(default_factory=lambda: Link(100e9 / 8, 5e-6))
    memory_bandwidth: float | None = None
    shm_passes: float = 3.0
    compute_efficiency: float = 0.5
    shared_host_cores: float = 0.0
    ps: PsServers | None = None
    algorithms: Mapping[str, AlgorithmCost] = field(default_factory=dict)
    collectives: Mapping[str, AlgorithmCost] = field(default_factory=dict)  # COLLECTIVES
    fsdp2: Fsdp2Cost | None = None  # None: not calibrated
    device_spec: Device | None = None  # a described device, or a table one with overrides
    backend: str = "auto"
    precision: str = "fp32"  # what non-AMP compute runs in: fp32 or tf32
    jitter: float | None = None  # per-rank step-time coefficient of variation
    contention: float | None = None  # slowdown of compute overlapped by collectives
    input_rate: float | None = None  # samples/s one node's input pipeline delivers
    optimizer_bytes: float = devices.OPTIMIZER_BYTES_PER_PARAM
    device_spread: float | None = None  # persistent per-device speed, coefficient of variation
    input_workers: int | None = None  # data-loader processes on a node
    worker_rate: float | None = None  # samples/s one loader process delivers

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def is_gpu(self) -> bool:
        """The device is an accelerator from the table or a description (not cpu/profiled)."""
        return self.device not in HOST_DEVICES

    @property
    def spec(self) -> Device:
        """The accelerator's figures (only for GPU devices)."""
        if self.device_spec is not None:
            return self.device_spec
        if not self.is_gpu:
            raise ClusterError(f"device {self.device!r} has no peak figures")
        return devices.get(self.device)

    @property
    def pcie_bandwidth(self) -> float:
        """Bytes/s per direction of a device's PCIe link (Gen3 x16 when not a known GPU)."""
        return self.spec.pcie_bandwidth if self.is_gpu else devices.PCIE_GEN3_X16

    @property
    def node_link(self) -> Link:
        """The intra-node link a collective over all of a node's devices uses (`Link.among`):
        PCIe when NVLink joins only groups of them."""
        per = self.devices_per_node
        return self.intra.among(per, per, self.pcie_bandwidth)

    @property
    def mem_bw(self) -> float:
        """Memory bandwidth for shared-memory collectives, compression passes, bucket copies."""
        if self.memory_bandwidth:
            return self.memory_bandwidth
        return self.spec.memory_bandwidth if self.is_gpu else 5e9

    def resolved_backend(self, profile_device: str = "cpu") -> str:
        """``nccl`` or ``gloo``: as set, else NCCL on accelerators and on ``profiled`` with a
        profile measured on CUDA, Gloo otherwise."""
        if self.backend != "auto":
            return self.backend
        if self.is_gpu or (self.device == "profiled" and profile_device.startswith("cuda")):
            return "nccl"
        return "gloo"

    def cost(self, algorithm: str) -> AlgorithmCost:
        return self.algorithms.get(algorithm, AlgorithmCost())

    def collective_cost(self, name: str) -> AlgorithmCost:
        """The calibrated correction of ``name`` (one of `COLLECTIVES`), else none."""
        return self.collectives.get(name, AlgorithmCost())

    @property
    def node_input_rate(self) -> float | None:
        """Samples/s a node's input pipeline delivers: ``input.samples_per_s`` as measured, else
        its loader processes times one process's rate (``DEFAULT_WORKER_RATE`` unless set);
        None: never the bottleneck."""
        if self.input_rate is not None:
            return self.input_rate
        if self.input_workers:
            return self.input_workers * (self.worker_rate or DEFAULT_WORKER_RATE)
        return None

    def without_input(self) -> Cluster:
        """The same cluster with an input pipeline that never binds."""
        return dataclasses.replace(self, input_rate=None, input_workers=None, worker_rate=None)

    def with_devices(self, n: int) -> Cluster:
        """The same cluster cut to ``n`` devices: full nodes, or one partial node, which on
        directly wired NVLink uses only the links among its devices (`Link.among`)."""
        per = self.devices_per_node
        if n <= per:
            intra = self.intra.among(n, per, self.pcie_bandwidth)
            return dataclasses.replace(self, nodes=1, devices_per_node=n, intra=intra)
        if n % per:
            raise ClusterError(f"{n} devices do not fill nodes of {per} devices")
        return dataclasses.replace(self, nodes=n // per)

    def to_dict(self) -> dict[str, Any]:
        """A plain mapping that `longboat.sim.cluster.from_dict` reads back (rates as
        ``'<bytes/s> B/s'``)."""
        out: dict[str, Any] = {
            "nodes": self.nodes,
            "devices_per_node": self.devices_per_node,
            "device": self.device_spec.to_dict() if self.device_spec else self.device,
            "backend": self.backend,
            "intra": _link_dict(self.intra, intra=True),
            "inter": _link_dict(self.inter, intra=False),
            "shm_passes": self.shm_passes,
            "compute": {
                "efficiency": self.compute_efficiency,
                "shared_host_cores": self.shared_host_cores,
                "precision": self.precision,
                "optimizer_bytes_per_param": self.optimizer_bytes,
            },
        }
        for key in ("jitter", "contention", "device_spread"):
            if getattr(self, key) is not None:
                out["compute"][key] = getattr(self, key)
        entry = {
            "samples_per_s": self.input_rate,
            "workers": self.input_workers,
            "worker_samples_per_s": self.worker_rate,
        }
        if any(v is not None for v in entry.values()):
            out["input"] = {k: v for k, v in entry.items() if v is not None}
        if self.memory_bandwidth:
            out["memory_bandwidth"] = rate_text(self.memory_bandwidth)
        if self.ps:
            ps = _link_dict(self.ps.link, intra=False)
            ps.pop("gpudirect")
            out["ps"] = {"servers": self.ps.servers} | ps
        if self.algorithms:
            out["algorithms"] = {k: dataclasses.asdict(v) for k, v in self.algorithms.items()}
        if self.collectives:
            out["collectives"] = {k: dataclasses.asdict(v) for k, v in self.collectives.items()}
        if self.fsdp2 is not None:
            out["fsdp2"] = dataclasses.asdict(self.fsdp2)
        return out


def _link_dict(link: Link, intra: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"bandwidth": rate_text(link.bandwidth), "latency": link.latency}
    if intra:
        out["kind"] = link.kind
        if link.links:
            out["links"] = link.links
        if link.group:
            out["group"] = link.group
        if link.pcie:
            out["pcie_bandwidth"] = rate_text(link.pcie)
    else:
        out["nics_per_node"] = link.nics_per_node
        out["gpudirect"] = link.gpudirect
    if link.efficiency != 1.0:
        out["efficiency"] = link.efficiency
    return out


#: Samples/s one data-loader process delivers when ``input.workers`` is given without
#: ``worker_samples_per_s``: ImageNet JPEG decoding with random-resized-crop and flip in a
#: PyTorch DataLoader worker on a fully loaded DGX node (NVIDIA's published ResNet-50 mixed
#: precision throughput on a DGX-1, 8 GPUs: 8,322 images/s from 8 x 8 workers; see docs/sim.md).
DEFAULT_WORKER_RATE = 130.0
