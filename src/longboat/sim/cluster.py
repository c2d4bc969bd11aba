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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from longboat.registry import ALGORITHMS as REGISTERED
from longboat.sim import devices
from longboat.sim.devices import Device, DeviceError
from longboat.sim.units import UnitError, bandwidth, duration, rate_text

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
        """A plain mapping that :func:`from_dict` reads back (rates as ``'<bytes/s> B/s'``)."""
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


_TOP = {
    "nodes",
    "devices_per_node",
    "device",
    "backend",
    "intra",
    "inter",
    "memory_bandwidth",
    "shm_passes",
    "compute",
    "input",
    "ps",
    "algorithms",
}
_COMPUTE = {
    "efficiency",
    "shared_host_cores",
    "precision",
    "jitter",
    "contention",
    "device_spread",
    "optimizer_bytes_per_param",
}
#: Samples/s one data-loader process delivers when ``input.workers`` is given without
#: ``worker_samples_per_s``: ImageNet JPEG decoding with random-resized-crop and flip in a
#: PyTorch DataLoader worker on a fully loaded DGX node (NVIDIA's published ResNet-50 mixed
#: precision throughput on a DGX-1, 8 GPUs: 8,322 images/s from 8 x 8 workers; see docs/sim.md).
DEFAULT_WORKER_RATE = 130.0


def _check_keys(data: Mapping[str, Any], allowed: set[str], where: str) -> None:
    if not isinstance(data, Mapping):
        raise ClusterError(f"{where}: expected a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ClusterError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")


def _positive_int(data: Mapping[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = data.get(key, default)
    if value is None:
        raise ClusterError(f"{where}: '{key}' is required (a positive integer)")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ClusterError(f"{where}: '{key}' must be a positive integer, got {value!r}")
    return value


def _fraction(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ClusterError(f"{where}: must be a number in (0, 1], got {value!r}")
    return float(value)


def _non_negative(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ClusterError(f"{where}: a number >= 0, got {value!r}")
    return float(value)


def _rate(value: Any, where: str) -> float:
    try:
        return bandwidth(value, where)
    except UnitError as exc:
        raise ClusterError(str(exc)) from None


def _time(value: Any, where: str) -> float:
    try:
        return duration(value, where)
    except UnitError as exc:
        raise ClusterError(str(exc)) from None


def _intra(data: Any, where: str, default: Link, spec: Device | None) -> Link:
    if data is None:
        return default
    keys = {"kind", "bandwidth", "links", "link_bandwidth", "latency", "efficiency", "group",
            "pcie_bandwidth"}  # fmt: skip
    _check_keys(data, keys, where)
    kind = data.get("kind", default.kind)
    if kind not in INTRA_KINDS:
        raise ClusterError(f"{where}.kind: {kind!r} is not one of {', '.join(INTRA_KINDS)}")
    links = data.get("links")
    if links is not None and kind not in ("nvlink", "nvswitch"):
        raise ClusterError(f"{where}.links: NVLink ports, only with kind nvlink or nvswitch")
    if links is not None and (
        isinstance(links, bool) or not isinstance(links, int | float) or links <= 0
    ):
        raise ClusterError(f"{where}.links: a positive number of NVLink ports, got {links!r}")
    if "link_bandwidth" in data and ("bandwidth" in data or links is None):
        raise ClusterError(
            f"{where}: give bandwidth (per device, all its links together) or links with "
            "link_bandwidth (per link and direction)"
        )
    if "bandwidth" in data:
        bw = _rate(data["bandwidth"], f"{where}.bandwidth")
    elif links is not None:
        bw = links * _rate(data.get("link_bandwidth", "25GB/s"), f"{where}.link_bandwidth")
    elif kind == default.kind:
        bw, links = default.bandwidth, default.links
    elif kind == "pcie":
        bw = spec.pcie_bandwidth if spec is not None else devices.PCIE_GEN3_X16
    elif kind in ("shm", "loopback"):
        bw = 2e9
    elif spec is not None and spec.nvlink_links:
        bw, links = spec.nvlink_bandwidth, spec.nvlink_links
    else:
        raise ClusterError(
            f"{where}: kind {kind} needs bandwidth (per device) or links and link_bandwidth"
        )
    latency = _time(data["latency"], f"{where}.latency") if "latency" in data else default.latency
    eff = _fraction(data["efficiency"], f"{where}.efficiency") if "efficiency" in data else 1.0
    group, pcie = _domains(data, kind, where)
    return Link(bw, latency, kind, 1, eff, float(links or 0.0), group=group, pcie=pcie)


def _domains(data: Mapping[str, Any], kind: str, where: str) -> tuple[int, float]:
    """``group`` and ``pcie_bandwidth`` of directly wired NVLink (see `Link.among`)."""
    for key in ("group", "pcie_bandwidth"):
        if key in data and kind != "nvlink":
            raise ClusterError(
                f"{where}.{key}: only with kind nvlink (NVLink joining groups of devices, "
                "e.g. bridged pairs: group: 2); a switch joins every device"
            )
    group = data.get("group", 0)
    if "group" in data and (isinstance(group, bool) or not isinstance(group, int) or group < 1):
        raise ClusterError(f"{where}.group: a positive integer of devices, got {group!r}")
    pcie = data.get("pcie_bandwidth")
    return group, _rate(pcie, f"{where}.pcie_bandwidth") if pcie is not None else 0.0


def _inter(data: Any, where: str, default: Link) -> Link:
    if data is None:
        return default
    keys = {"bandwidth", "latency", "nics_per_node", "efficiency", "gpudirect"}
    _check_keys(data, keys, where)
    bw = _rate(data["bandwidth"], f"{where}.bandwidth") if "bandwidth" in data else None
    lat = _time(data["latency"], f"{where}.latency") if "latency" in data else None
    eff = _fraction(data["efficiency"], f"{where}.efficiency") if "efficiency" in data else 1.0
    gdr = data.get("gpudirect", default.gpudirect)
    if not isinstance(gdr, bool):
        raise ClusterError(f"{where}.gpudirect: true or false, got {gdr!r}")
    return Link(
        bw if bw is not None else default.bandwidth,
        lat if lat is not None else default.latency,
        "net",
        _positive_int(data, "nics_per_node", where, default.nics_per_node),
        eff,
        gpudirect=gdr,
    )


def default_intra(device: str, spec: Device | None) -> Link:
    """Host devices: a loopback link; GPUs: their NVLink ports behind NVSwitch when they have 12
    or more (DGX A100/H100), directly linked otherwise (DGX-1), PCIe without NVLink."""
    if spec is None:
        return Link(2e9, 20e-6, "loopback")
    if spec.nvlink_links == 0:
        return Link(spec.pcie_bandwidth, PCIE_LATENCY, "pcie")
    kind = "nvswitch" if spec.nvlink_links >= 12 else "nvlink"
    return Link(spec.nvlink_bandwidth, 3e-6, kind, links=float(spec.nvlink_links))


def _device(data: Mapping[str, Any], where: str) -> tuple[str, Device | None]:
    raw = data.get("device", "cpu")
    try:
        if isinstance(raw, Mapping):
            spec = devices.from_dict(raw, f"{where}.device")
            return spec.name, spec
        name = str(raw)
        if name in HOST_DEVICES:
            return name, None
        return name, devices.get(name)
    except DeviceError as exc:
        raise ClusterError(f"{where}.device: {exc}") from None


def _positive_rate(value: Any, where: str, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ClusterError(f"{where}: {what}, a number > 0, got {value!r}")
    return float(value)


def _input(data: Any, where: str) -> tuple[float | None, int | None, float | None]:
    """(samples_per_s, workers, worker_samples_per_s) of the ``input`` section."""
    if data is None:
        return None, None, None
    _check_keys(data, {"samples_per_s", "workers", "worker_samples_per_s"}, where)
    if "samples_per_s" in data and ("workers" in data or "worker_samples_per_s" in data):
        raise ClusterError(
            f"{where}: give samples_per_s (the node's measured rate) or workers with "
            "worker_samples_per_s (loader processes and one process's rate), not both"
        )
    if "worker_samples_per_s" in data and "workers" not in data:
        raise ClusterError(f"{where}.worker_samples_per_s needs workers (processes per node)")
    rate = data.get("samples_per_s")
    worker_rate = data.get("worker_samples_per_s")
    return (
        _positive_rate(rate, f"{where}.samples_per_s", "samples/s per node")
        if rate is not None
        else None,
        _positive_int(data, "workers", where) if "workers" in data else None,
        _positive_rate(worker_rate, f"{where}.worker_samples_per_s", "samples/s per process")
        if worker_rate is not None
        else None,
    )


def from_dict(data: Mapping[str, Any], where: str = "cluster") -> Cluster:
    """Validate and build a :class:`Cluster`; errors name the key and the allowed values."""
    _check_keys(data, _TOP, where)
    device, spec = _device(data, where)
    custom = spec if isinstance(data.get("device"), Mapping) else None
    backend = data.get("backend", "auto")
    if backend not in BACKENDS:
        raise ClusterError(f"{where}.backend: {backend!r} is not one of {', '.join(BACKENDS)}")
    compute = data.get("compute") or {}
    _check_keys(compute, _COMPUTE, f"{where}.compute")
    cores = _non_negative(compute.get("shared_host_cores", 0), f"{where}.compute.shared_host_cores")
    precision = compute.get("precision", "fp32")
    if precision not in ("fp32", "tf32"):
        raise ClusterError(
            f"{where}.compute.precision: {precision!r}; fp32 or tf32 (AMP picks fp16/bf16 "
            "from the Strategy's amp_configs)"
        )
    extras = {
        key: _non_negative(compute[key], f"{where}.compute.{key}")
        for key in ("jitter", "contention", "device_spread")
        if compute.get(key) is not None
    }
    opt_bytes = compute.get("optimizer_bytes_per_param", devices.OPTIMIZER_BYTES_PER_PARAM)
    if isinstance(opt_bytes, bool) or not isinstance(opt_bytes, int | float) or opt_bytes <= 0:
        raise ClusterError(f"{where}.compute.optimizer_bytes_per_param: > 0, got {opt_bytes!r}")
    input_rate, workers, worker_rate = _input(data.get("input"), f"{where}.input")
    ps = None
    if data.get("ps"):
        ps_data = dict(data["ps"])
        _check_keys(
            ps_data,
            {"servers", "bandwidth", "latency", "nics_per_node", "efficiency"},
            f"{where}.ps",
        )
        servers = _positive_int(ps_data, "servers", f"{where}.ps")
        ps_data.pop("servers")
        ps = PsServers(servers, _inter(ps_data, f"{where}.ps", Link(25e9 / 8, 20e-6)))
    algorithms = {}
    for name, cost in (data.get("algorithms") or {}).items():
        if name not in (modelled := REGISTERED.having("cost")):
            raise ClusterError(
                f"{where}.algorithms: {name!r} is not one of {', '.join(modelled)} (the "
                "allreduce algorithms with a cost model)"
            )
        _check_keys(cost, {"bandwidth_efficiency", "overhead"}, f"{where}.algorithms.{name}")
        eff = cost.get("bandwidth_efficiency", 1.0)
        if isinstance(eff, bool) or not isinstance(eff, int | float) or eff <= 0:
            raise ClusterError(f"{where}.algorithms.{name}.bandwidth_efficiency: > 0, got {eff!r}")
        overhead = _time(cost.get("overhead", 0.0), f"{where}.algorithms.{name}.overhead")
        algorithms[name] = AlgorithmCost(float(eff), overhead)
    mem = data.get("memory_bandwidth")
    mem_bw = _rate(mem, f"{where}.memory_bandwidth") if mem is not None else None
    passes = data.get("shm_passes", 3.0)
    if isinstance(passes, bool) or not isinstance(passes, int | float) or passes <= 0:
        raise ClusterError(f"{where}.shm_passes: a positive number, got {passes!r}")
    intra = _intra(data.get("intra"), f"{where}.intra", default_intra(device, spec), spec)
    if spec is not None and intra.kind in ("shm", "loopback"):
        raise ClusterError(
            f"{where}.intra.kind: {intra.kind} is a host link; GPUs use nvlink, nvswitch or pcie"
        )
    per = _positive_int(data, "devices_per_node", where)
    if intra.group > per:
        raise ClusterError(
            f"{where}.intra.group: {intra.group} devices, more than devices_per_node ({per})"
        )
    if intra.group and per % intra.group:
        raise ClusterError(
            f"{where}.intra.group: {intra.group} does not divide devices_per_node ({per}); "
            "NVLink domains are equal groups of a node's devices"
        )
    return Cluster(
        nodes=_positive_int(data, "nodes", where),
        devices_per_node=per,
        device=device,
        intra=intra,
        inter=_inter(data.get("inter"), f"{where}.inter", Link(100e9 / 8, 5e-6)),
        memory_bandwidth=mem_bw,
        shm_passes=float(passes),
        compute_efficiency=_fraction(compute.get("efficiency", 0.5), f"{where}.compute.efficiency"),
        shared_host_cores=cores,
        ps=ps,
        algorithms=algorithms,
        device_spec=custom,
        backend=backend,
        precision=precision,
        jitter=extras.get("jitter"),
        contention=extras.get("contention"),
        input_rate=input_rate,
        optimizer_bytes=float(opt_bytes),
        device_spread=extras.get("device_spread"),
        input_workers=workers,
        worker_rate=worker_rate,
    )


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
