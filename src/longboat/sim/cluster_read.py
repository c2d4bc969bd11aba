"""Reading a cluster description (a mapping, as from YAML) into a `Cluster`: one typed reader
per section, each error naming the key and what is allowed (the format: `longboat.sim.cluster`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from longboat.registry import ALGORITHMS as REGISTERED
from longboat.sim import devices
from longboat.sim.cluster_types import (
    BACKENDS,
    COLLECTIVES,
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
from longboat.sim.devices import Device, DeviceError
from longboat.sim.units import UnitError, bandwidth, duration

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
    "collectives",
    "fsdp2",
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
_INTRA = {"kind", "bandwidth", "links", "link_bandwidth", "latency", "efficiency", "group",
          "pcie_bandwidth"}  # fmt: skip
_INTER = {"bandwidth", "latency", "nics_per_node", "efficiency", "gpudirect"}
_PS = {"servers", "bandwidth", "latency", "nics_per_node", "efficiency"}
_INPUT = {"samples_per_s", "workers", "worker_samples_per_s"}
_ALGORITHM = {"bandwidth_efficiency", "overhead"}
_FSDP2 = {"step_overhead", "unit_overhead", "param_overhead", "byte_overhead"}
_EXTRAS = ("jitter", "contention", "device_spread")


# -- value readers -------------------------------------------------------------------------


def _check_keys(data: Mapping[str, Any], allowed: set[str], where: str) -> None:
    if not isinstance(data, Mapping):
        raise ClusterError(f"{where}: expected a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ClusterError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float)


def _number(value: Any, where: str, ok: Callable[[float], bool], expected: str) -> float:
    """``value`` as a float when it is a number (not a bool) that ``ok`` accepts; otherwise
    ``<where>: <expected>, got <value>``."""
    if not _is_number(value) or not ok(value):
        raise ClusterError(f"{where}: {expected}, got {value!r}")
    return float(value)


def _positive(value: Any, where: str, expected: str = "> 0") -> float:
    return _number(value, where, lambda x: x > 0, expected)


def _fraction(value: Any, where: str) -> float:
    return _number(value, where, lambda x: 0 < x <= 1, "must be a number in (0, 1]")


def _non_negative(value: Any, where: str) -> float:
    return _number(value, where, lambda x: x >= 0, "a number >= 0")


def _positive_int(data: Mapping[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = data.get(key, default)
    if value is None:
        raise ClusterError(f"{where}: '{key}' is required (a positive integer)")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ClusterError(f"{where}: '{key}' must be a positive integer, got {value!r}")
    return value


def _choice(value: Any, options: tuple[str, ...], where: str) -> Any:
    if value not in options:
        raise ClusterError(f"{where}: {value!r} is not one of {', '.join(options)}")
    return value


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


def _given(
    data: Mapping[str, Any], key: str, where: str, read: Callable[[Any, str], Any], default: Any
) -> Any:
    """``read(data[key], '<where>.<key>')`` when ``key`` is present, else ``default``."""
    return read(data[key], f"{where}.{key}") if key in data else default


def _set(data: Mapping[str, Any], key: str, where: str, read: Callable[[Any, str], Any]) -> Any:
    """``read(data[key], '<where>.<key>')`` when ``key`` holds a value (not null), else None."""
    value = data.get(key)
    return read(value, f"{where}.{key}") if value is not None else None


# -- sections ------------------------------------------------------------------------------


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


def _compute(compute: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The ``compute`` section's Cluster fields, all but ``efficiency`` (read last)."""
    _check_keys(compute, _COMPUTE, where)
    cores = _non_negative(compute.get("shared_host_cores", 0), f"{where}.shared_host_cores")
    precision = compute.get("precision", "fp32")
    if precision not in ("fp32", "tf32"):
        raise ClusterError(
            f"{where}.precision: {precision!r}; fp32 or tf32 (AMP picks fp16/bf16 "
            "from the Strategy's amp_configs)"
        )
    extras = {key: _set(compute, key, where, _non_negative) for key in _EXTRAS}
    opt_bytes = compute.get("optimizer_bytes_per_param", devices.OPTIMIZER_BYTES_PER_PARAM)
    return {
        "shared_host_cores": cores,
        "precision": precision,
        **extras,
        "optimizer_bytes": _positive(opt_bytes, f"{where}.optimizer_bytes_per_param"),
    }


def _input(data: Any, where: str) -> dict[str, Any]:
    """``input_rate``, ``input_workers`` and ``worker_rate`` from the ``input`` section."""
    if data is None:
        return {"input_rate": None, "input_workers": None, "worker_rate": None}
    _check_keys(data, _INPUT, where)
    if "samples_per_s" in data and ("workers" in data or "worker_samples_per_s" in data):
        raise ClusterError(
            f"{where}: give samples_per_s (the node's measured rate) or workers with "
            "worker_samples_per_s (loader processes and one process's rate), not both"
        )
    if "worker_samples_per_s" in data and "workers" not in data:
        raise ClusterError(f"{where}.worker_samples_per_s needs workers (processes per node)")
    node_rate = _set(data, "samples_per_s", where, _samples_rate("samples/s per node"))
    workers = _positive_int(data, "workers", where) if "workers" in data else None
    process_rate = _samples_rate("samples/s per process")
    worker_rate = _set(data, "worker_samples_per_s", where, process_rate)
    return {"input_rate": node_rate, "input_workers": workers, "worker_rate": worker_rate}


def _samples_rate(what: str) -> Callable[[Any, str], float]:
    return lambda value, where: _positive(value, where, f"{what}, a number > 0")


def _ps(data: Any, where: str) -> PsServers | None:
    if not data:
        return None
    ps_data = dict(data)
    _check_keys(ps_data, _PS, where)
    servers = _positive_int(ps_data, "servers", where)
    ps_data.pop("servers")
    return PsServers(servers, _inter(ps_data, where, Link(25e9 / 8, 20e-6)))


def _algorithms(data: Mapping[str, Any], where: str) -> dict[str, AlgorithmCost]:
    return {name: _algorithm(name, cost, where) for name, cost in data.items()}


def _algorithm(name: str, cost: Any, where: str) -> AlgorithmCost:
    if name not in (modelled := REGISTERED.having("cost")):
        raise ClusterError(
            f"{where}: {name!r} is not one of {', '.join(modelled)} (the "
            "allreduce algorithms with a cost model)"
        )
    where = f"{where}.{name}"
    _check_keys(cost, _ALGORITHM, where)
    eff = _positive(cost.get("bandwidth_efficiency", 1.0), f"{where}.bandwidth_efficiency")
    return AlgorithmCost(eff, _time(cost.get("overhead", 0.0), f"{where}.overhead"))


def _collectives(data: Mapping[str, Any], where: str) -> dict[str, AlgorithmCost]:
    out = {}
    for name, cost in data.items():
        if name not in COLLECTIVES:
            raise ClusterError(f"{where}: {name!r} is not one of {', '.join(COLLECTIVES)}")
        _check_keys(cost, _ALGORITHM, f"{where}.{name}")
        eff = _positive(
            cost.get("bandwidth_efficiency", 1.0), f"{where}.{name}.bandwidth_efficiency"
        )
        out[name] = AlgorithmCost(eff, _time(cost.get("overhead", 0.0), f"{where}.{name}.overhead"))
    return out


def _fsdp2(data: Any, where: str) -> Fsdp2Cost | None:
    if data is None:
        return None
    _check_keys(data, _FSDP2, where)
    times = {k: _time(data.get(k, 0.0), f"{where}.{k}") for k in sorted(_FSDP2 - {"byte_overhead"})}
    per_byte = _number(
        data.get("byte_overhead", 0.0), f"{where}.byte_overhead", lambda v: v >= 0,
        "seconds per byte, at least 0",
    )  # fmt: skip
    return Fsdp2Cost(**times, byte_overhead=per_byte)


def _inter(data: Any, where: str, default: Link) -> Link:
    if data is None:
        return default
    _check_keys(data, _INTER, where)
    bw = _given(data, "bandwidth", where, _rate, default.bandwidth)
    lat = _given(data, "latency", where, _time, default.latency)
    eff = _given(data, "efficiency", where, _fraction, 1.0)
    gdr = data.get("gpudirect", default.gpudirect)
    if not isinstance(gdr, bool):
        raise ClusterError(f"{where}.gpudirect: true or false, got {gdr!r}")
    nics = _positive_int(data, "nics_per_node", where, default.nics_per_node)
    return Link(bw, lat, "net", nics, eff, gpudirect=gdr)


def default_intra(device: str, spec: Device | None) -> Link:
    """Host devices: a loopback link; GPUs: their NVLink ports behind NVSwitch when they have 12
    or more (DGX A100/H100), directly linked otherwise (DGX-1), PCIe without NVLink."""
    if spec is None:
        return Link(2e9, 20e-6, "loopback")
    if spec.nvlink_links == 0:
        return Link(spec.pcie_bandwidth, PCIE_LATENCY, "pcie")
    kind = "nvswitch" if spec.nvlink_links >= 12 else "nvlink"
    return Link(spec.nvlink_bandwidth, 3e-6, kind, links=float(spec.nvlink_links))


def _intra(data: Any, where: str, default: Link, spec: Device | None) -> Link:
    if data is None:
        return default
    _check_keys(data, _INTRA, where)
    kind = _choice(data.get("kind", default.kind), INTRA_KINDS, f"{where}.kind")
    links = _ports(data, kind, where)
    bw, links = _intra_bandwidth(data, kind, links, where, default, spec)
    latency = _given(data, "latency", where, _time, default.latency)
    eff = _given(data, "efficiency", where, _fraction, 1.0)
    group, pcie = _domains(data, kind, where)
    return Link(bw, latency, kind, 1, eff, float(links or 0.0), group=group, pcie=pcie)


def _ports(data: Mapping[str, Any], kind: str, where: str) -> Any:
    """``links``: NVLink ports per device, or None."""
    links = data.get("links")
    if links is None:
        return None
    if kind not in ("nvlink", "nvswitch"):
        raise ClusterError(f"{where}.links: NVLink ports, only with kind nvlink or nvswitch")
    _positive(links, f"{where}.links", "a positive number of NVLink ports")
    return links


def _intra_bandwidth(
    data: Mapping[str, Any], kind: str, links: Any, where: str, default: Link, spec: Device | None
) -> tuple[float, Any]:
    """(bytes/s per device, NVLink ports): as given, else the default link's or the kind's."""
    if "link_bandwidth" in data and ("bandwidth" in data or links is None):
        raise ClusterError(
            f"{where}: give bandwidth (per device, all its links together) or links with "
            "link_bandwidth (per link and direction)"
        )
    if "bandwidth" in data:
        return _rate(data["bandwidth"], f"{where}.bandwidth"), links
    if links is not None:
        return links * _rate(data.get("link_bandwidth", "25GB/s"), f"{where}.link_bandwidth"), links
    if kind == default.kind:
        return default.bandwidth, default.links
    return _kind_bandwidth(kind, where, spec)


def _kind_bandwidth(kind: str, where: str, spec: Device | None) -> tuple[float, Any]:
    """(bytes/s per device, NVLink ports) of an intra link described by its kind alone."""
    if kind == "pcie":
        return (spec.pcie_bandwidth if spec is not None else devices.PCIE_GEN3_X16), None
    if kind in ("shm", "loopback"):
        return 2e9, None
    if spec is not None and spec.nvlink_links:
        return spec.nvlink_bandwidth, spec.nvlink_links
    raise ClusterError(
        f"{where}: kind {kind} needs bandwidth (per device) or links and link_bandwidth"
    )


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
    return group, _set(data, "pcie_bandwidth", where, _rate) or 0.0


def _nodes(data: Mapping[str, Any], where: str, device: str, spec: Device | None) -> dict[str, Any]:
    """``intra``, ``devices_per_node`` and ``nodes``, checked against each other."""
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
    nodes = _positive_int(data, "nodes", where)
    return {"intra": intra, "devices_per_node": per, "nodes": nodes}


def from_dict(data: Mapping[str, Any], where: str = "cluster") -> Cluster:
    """Validate and build a :class:`Cluster`; errors name the key and the allowed values."""
    _check_keys(data, _TOP, where)
    device, spec = _device(data, where)
    compute = data.get("compute") or {}
    fields = {
        "device": device,
        "device_spec": spec if isinstance(data.get("device"), Mapping) else None,
        "backend": _choice(data.get("backend", "auto"), BACKENDS, f"{where}.backend"),
        **_compute(compute, f"{where}.compute"),
        **_input(data.get("input"), f"{where}.input"),
        "ps": _ps(data.get("ps"), f"{where}.ps"),
        "algorithms": _algorithms(data.get("algorithms") or {}, f"{where}.algorithms"),
        "collectives": _collectives(data.get("collectives") or {}, f"{where}.collectives"),
        "fsdp2": _fsdp2(data.get("fsdp2"), f"{where}.fsdp2"),
        "memory_bandwidth": _set(data, "memory_bandwidth", where, _rate),
        "shm_passes": _positive(
            data.get("shm_passes", 3.0), f"{where}.shm_passes", "a positive number"
        ),
        **_nodes(data, where, device, spec),
        "inter": _inter(data.get("inter"), f"{where}.inter", Link(100e9 / 8, 5e-6)),
        "compute_efficiency": _fraction(
            compute.get("efficiency", 0.5), f"{where}.compute.efficiency"
        ),
    }
    return Cluster(**fields)
