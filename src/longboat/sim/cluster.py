"""The simulated cluster: nodes, devices, links, parameter servers; read from YAML or flags.

A cluster file (every key optional except ``nodes`` and ``devices_per_node``)::

    nodes: 16
    devices_per_node: 8
    device: A100                 # cpu (the profile's own times) | V100 | A100 | H100
    intra: {kind: nvlink, bandwidth: 300GB/s, latency: 3us}
    inter: {bandwidth: 200gbit, latency: 5us, nics_per_node: 4, efficiency: 0.95}
    memory_bandwidth: 1500GB/s   # default: the device's
    compute: {efficiency: 0.5, shared_host_cores: 0}
    ps: {servers: 4, bandwidth: 25gbit, latency: 20us}
    algorithms: {ring: {bandwidth_efficiency: 0.8, overhead: 50us}}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from longboat.sim import devices
from longboat.sim.units import UnitError, bandwidth, duration

INTRA_KINDS = ("nvlink", "pcie", "shm", "loopback")
ALGORITHMS = ("native", "ring", "hierarchical", "shm")


class ClusterError(ValueError):
    """A cluster description that cannot be used, with the key and what is allowed."""


@dataclass(frozen=True)
class Link:
    """One link: bytes/s per direction, one-way latency per message, payload efficiency."""

    bandwidth: float
    latency: float
    kind: str = "net"
    nics_per_node: int = 1
    efficiency: float = 1.0

    @property
    def rate(self) -> float:
        """Payload bytes/s (``bandwidth * efficiency``)."""
        return self.bandwidth * self.efficiency


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
    intra: Link = field(default_factory=lambda: Link(300e9, 3e-6, "nvlink"))
    inter: Link = field(default_factory=lambda: Link(100e9 / 8, 5e-6))
    memory_bandwidth: float | None = None
    shm_passes: float = 3.0
    compute_efficiency: float = 0.5
    shared_host_cores: float = 0.0
    ps: PsServers | None = None
    algorithms: Mapping[str, AlgorithmCost] = field(default_factory=dict)

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def mem_bw(self) -> float:
        """Memory bandwidth for shared-memory collectives and compression passes."""
        if self.memory_bandwidth:
            return self.memory_bandwidth
        return devices.get(self.device).memory_bandwidth if self.device != "cpu" else 5e9

    def cost(self, algorithm: str) -> AlgorithmCost:
        return self.algorithms.get(algorithm, AlgorithmCost())

    def with_devices(self, n: int) -> Cluster:
        """The same cluster cut to ``n`` devices: full nodes, or one partial node."""
        per = self.devices_per_node
        if n <= per:
            return dataclasses.replace(self, nodes=1, devices_per_node=n)
        if n % per:
            raise ClusterError(f"{n} devices do not fill nodes of {per} devices")
        return dataclasses.replace(self, nodes=n // per)

    def to_dict(self) -> dict[str, Any]:
        """A plain mapping that :func:`from_dict` reads back (numbers in bytes/s, seconds)."""
        out: dict[str, Any] = {
            "nodes": self.nodes,
            "devices_per_node": self.devices_per_node,
            "device": self.device,
            "intra": _link_dict(self.intra, intra=True),
            "inter": _link_dict(self.inter, intra=False),
            "shm_passes": self.shm_passes,
            "compute": {
                "efficiency": self.compute_efficiency,
                "shared_host_cores": self.shared_host_cores,
            },
        }
        if self.memory_bandwidth:
            out["memory_bandwidth"] = self.memory_bandwidth
        if self.ps:
            out["ps"] = {"servers": self.ps.servers} | _link_dict(self.ps.link, intra=False)
        if self.algorithms:
            out["algorithms"] = {k: dataclasses.asdict(v) for k, v in self.algorithms.items()}
        return out


def _link_dict(link: Link, intra: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"bandwidth": link.bandwidth, "latency": link.latency}
    if intra:
        out["kind"] = link.kind
    else:
        out["nics_per_node"] = link.nics_per_node
    if link.efficiency != 1.0:
        out["efficiency"] = link.efficiency
    return out


_TOP = {
    "nodes",
    "devices_per_node",
    "device",
    "intra",
    "inter",
    "memory_bandwidth",
    "shm_passes",
    "compute",
    "ps",
    "algorithms",
}


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


def _link(data: Any, where: str, default: Link, intra: bool) -> Link:
    if data is None:
        return default
    keys = {"bandwidth", "latency", "efficiency"} | ({"kind"} if intra else {"nics_per_node"})
    _check_keys(data, keys, where)
    try:
        bw = bandwidth(data["bandwidth"], f"{where}.bandwidth") if "bandwidth" in data else None
        lat = duration(data["latency"], f"{where}.latency") if "latency" in data else None
    except UnitError as exc:
        raise ClusterError(str(exc)) from None
    kind = data.get("kind", default.kind)
    if intra and kind not in INTRA_KINDS:
        raise ClusterError(f"{where}.kind: {kind!r} is not one of {', '.join(INTRA_KINDS)}")
    eff = _fraction(data["efficiency"], f"{where}.efficiency") if "efficiency" in data else 1.0
    return Link(
        bw if bw is not None else default.bandwidth,
        lat if lat is not None else default.latency,
        kind,
        _positive_int(data, "nics_per_node", where, default.nics_per_node),
        eff,
    )


def default_intra(device: str) -> Link:
    if device == "cpu":
        return Link(2e9, 20e-6, "loopback")
    spec = devices.get(device)
    return Link(spec.nvlink_bandwidth, 3e-6, "nvlink")


def from_dict(data: Mapping[str, Any], where: str = "cluster") -> Cluster:
    """Validate and build a :class:`Cluster`; errors name the key and the allowed values."""
    _check_keys(data, _TOP, where)
    device = str(data.get("device", "cpu"))
    if device != "cpu":
        try:
            devices.get(device)
        except KeyError as exc:
            raise ClusterError(f"{where}.device: {exc.args[0]}") from None
    compute = data.get("compute") or {}
    _check_keys(compute, {"efficiency", "shared_host_cores"}, f"{where}.compute")
    cores = compute.get("shared_host_cores", 0)
    if isinstance(cores, bool) or not isinstance(cores, int | float) or cores < 0:
        raise ClusterError(f"{where}.compute.shared_host_cores: a number >= 0, got {cores!r}")
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
        ps = PsServers(servers, _link(ps_data, f"{where}.ps", Link(25e9 / 8, 20e-6), intra=False))
    algorithms = {}
    for name, cost in (data.get("algorithms") or {}).items():
        if name not in ALGORITHMS:
            raise ClusterError(
                f"{where}.algorithms: {name!r} is not one of {', '.join(ALGORITHMS)}"
            )
        _check_keys(cost, {"bandwidth_efficiency", "overhead"}, f"{where}.algorithms.{name}")
        eff = cost.get("bandwidth_efficiency", 1.0)
        if isinstance(eff, bool) or not isinstance(eff, int | float) or eff <= 0:
            raise ClusterError(f"{where}.algorithms.{name}.bandwidth_efficiency: > 0, got {eff!r}")
        try:
            overhead = duration(cost.get("overhead", 0.0), f"{where}.algorithms.{name}.overhead")
        except UnitError as exc:
            raise ClusterError(str(exc)) from None
        algorithms[name] = AlgorithmCost(float(eff), overhead)
    try:
        mem = data.get("memory_bandwidth")
        mem_bw = bandwidth(mem, f"{where}.memory_bandwidth") if mem is not None else None
    except UnitError as exc:
        raise ClusterError(str(exc)) from None
    passes = data.get("shm_passes", 3.0)
    if isinstance(passes, bool) or not isinstance(passes, int | float) or passes <= 0:
        raise ClusterError(f"{where}.shm_passes: a positive number, got {passes!r}")
    return Cluster(
        nodes=_positive_int(data, "nodes", where),
        devices_per_node=_positive_int(data, "devices_per_node", where),
        device=device,
        intra=_link(data.get("intra"), f"{where}.intra", default_intra(device), intra=True),
        inter=_link(data.get("inter"), f"{where}.inter", Link(100e9 / 8, 5e-6), intra=False),
        memory_bandwidth=mem_bw,
        shm_passes=float(passes),
        compute_efficiency=_fraction(compute.get("efficiency", 0.5), f"{where}.compute.efficiency"),
        shared_host_cores=float(cores),
        ps=ps,
        algorithms=algorithms,
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
