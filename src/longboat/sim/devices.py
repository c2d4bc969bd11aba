"""Accelerators: published peak figures (or a user's own), and the efficiency model that turns a
profile into compute times on one of them.

Model: a step's forward+backward takes ``flops / (peak * efficiency) + layers * launch``
on the device (``peak``: the dense figure of the precision the step computes in: fp32, tf32, or
fp16/bf16 tensor cores under AMP; ``efficiency``: the fraction of peak a real model sustains,
0.5 by default or calibrated from one measured step; ``launch``: a fixed cost per layer and
pass). That total is spread over the step in the proportions the profile measured, so the order
and spacing of gradient-ready times are kept. The optimizer is memory-bound:
``bytes_per_param`` (20 for momentum SGD: read weight, grad, momentum; write weight, momentum)
at 80 % of the memory bandwidth.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from longboat.sim.units import UnitError, bandwidth, flop_rate, rate_text

PRECISIONS = ("fp32", "tf32", "fp16", "bf16")
ARCHS = ("volta", "ampere", "hopper", "blackwell")
NVLINK_LINK_BW = 25e9  # bytes/s per link and direction, NVLink 2, 3 and 4
#: bytes/s per direction of a x16 PCIe link: Gen3 (V100), Gen4 (A100), Gen5 (H100, H200)
PCIE_GEN3_X16, PCIE_GEN4_X16, PCIE_GEN5_X16 = 15.75e9, 31.5e9, 63e9


class DeviceError(ValueError):
    """A device that is not known or not fully described."""


@dataclass(frozen=True)
class Device:
    """One accelerator: dense peak FLOP/s per precision, memory bandwidth, NVLink ports and
    its PCIe link to the host."""

    name: str
    peak_flops: Mapping[str, float]  # precision -> dense FLOP/s (no sparsity)
    memory_bandwidth: float  # bytes/s
    nvlink_links: int = 0  # NVLink ports per device
    nvlink_link_bandwidth: float = NVLINK_LINK_BW  # bytes/s per link and direction
    sms: int = 0  # streaming multiprocessors (0: unknown)
    arch: str = "ampere"  # selects NCCL's per-architecture constants (longboat.sim.nccl)
    pcie_bandwidth: float = PCIE_GEN3_X16  # bytes/s per direction of its host link
    memory: float = 0.0  # bytes of device memory (0: unknown)

    @property
    def nvlink_bandwidth(self) -> float:
        """Aggregate NVLink bytes/s per direction."""
        return self.nvlink_links * self.nvlink_link_bandwidth

    def peak(self, precision: str) -> float:
        """Dense FLOP/s in ``precision``; a precision the description lacks is an error."""
        if precision not in self.peak_flops:
            given = ", ".join(sorted(self.peak_flops))
            raise DeviceError(
                f"device {self.name}: no peak FLOP/s for {precision} (given: {given}); "
                f"add it, e.g. --peak-flops {precision}=312TFLOPS or "
                f"device: {{peak_flops: {{{precision}: 312TFLOPS}}}}"
            )
        return self.peak_flops[precision]

    def to_dict(self) -> dict[str, Any]:
        """A mapping :func:`from_dict` reads back."""
        return {
            "name": self.name,
            "peak_flops": {k: float(v) for k, v in self.peak_flops.items()},
            "memory_bandwidth": rate_text(self.memory_bandwidth),
            "nvlink": {
                "links": self.nvlink_links,
                "link_bandwidth": rate_text(self.nvlink_link_bandwidth),
            },
            "sms": self.sms,
            "arch": self.arch,
            "pcie_bandwidth": rate_text(self.pcie_bandwidth),
            "memory_gb": self.memory / 1e9,
        }


def _table(name: str, fp32: float, tf32: float, half: float, bf16: float, mem: float,
           links: int, sms: int, arch: str, pcie: float, gb: float) -> Device:  # fmt: skip
    peaks = {"fp32": fp32, "tf32": tf32, "fp16": half, "bf16": bf16}
    return Device(name, peaks, mem, links, NVLINK_LINK_BW, sms, arch, pcie, gb * 1e9)


#: Vendor data sheets (dense figures, no sparsity): SXM parts, then PCIe cards. V100 has no TF32
#: or bf16 tensor cores: those precisions run at the fp32 figure. PCIe: the generation of each
#: part's host link. Memory: the largest variant sold (V100 32 GB, A100 80 GB).
DEVICES: dict[str, Device] = {
    "V100": _table("V100", 15.7e12, 15.7e12, 125e12, 15.7e12, 900e9, 6, 80, "volta",
                   PCIE_GEN3_X16, 32),
    "A100": _table("A100", 19.5e12, 156e12, 312e12, 312e12, 2039e9, 12, 108, "ampere",
                   PCIE_GEN4_X16, 80),
    "H100": _table("H100", 67e12, 494.7e12, 989.4e12, 989.4e12, 3350e9, 18, 132, "hopper",
                   PCIE_GEN5_X16, 80),
    "H200": _table("H200", 67e12, 494.7e12, 989.4e12, 989.4e12, 4800e9, 18, 132, "hopper",
                   PCIE_GEN5_X16, 141),
    # PCIe cards: no NVLink of their own (an NVLink bridge is described by intra:
    # {kind: nvlink, links: 12, group: 2}); Ada (L40S, L4) takes Ampere's NCCL constants.
    "A100-PCIe": _table("A100-PCIe", 19.5e12, 156e12, 312e12, 312e12, 1935e9, 0, 108, "ampere",
                        PCIE_GEN4_X16, 80),
    "H100-PCIe": _table("H100-PCIe", 51.2e12, 378e12, 756e12, 756e12, 2000e9, 0, 114, "hopper",
                        PCIE_GEN5_X16, 80),
    "L40S": _table("L40S", 91.6e12, 183e12, 362.05e12, 362.05e12, 864e9, 0, 142, "ampere",
                   PCIE_GEN4_X16, 48),
    "A10": _table("A10", 31.2e12, 62.5e12, 125e12, 125e12, 600e9, 0, 72, "ampere",
                  PCIE_GEN4_X16, 24),
    "L4": _table("L4", 30.3e12, 60e12, 121e12, 121e12, 300e9, 0, 58, "ampere", PCIE_GEN4_X16, 24),
}  # fmt: skip

LAUNCH_S = 5e-6
OPTIMIZER_BYTES_PER_PARAM = 20
MEMORY_EFFICIENCY = 0.8


def get(name: str) -> Device:
    """The table's device called ``name`` (case-insensitive)."""
    for key, device in DEVICES.items():
        if key.lower() == name.lower():
            return device
    raise DeviceError(
        f"unknown device {name!r}; choose cpu, profiled, one of {', '.join(DEVICES)}, or "
        "describe it: device: {name: ..., peak_flops: {fp32: ..., bf16: ...}, "
        "memory_bandwidth: ...} (flags: --peak-flops, --memory-bandwidth)"
    )


def known(name: str) -> bool:
    return any(key.lower() == name.lower() for key in DEVICES)


def from_dict(data: Mapping[str, Any], where: str = "device") -> Device:
    """A device described by a mapping; with a table ``name`` the given keys override the
    table's figures, otherwise ``peak_flops`` (with fp32) and ``memory_bandwidth`` are
    required."""
    allowed = {
        "name", "peak_flops", "memory_bandwidth", "nvlink", "sms", "arch", "pcie_bandwidth",
        "memory_gb",
    }  # fmt: skip
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise DeviceError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise DeviceError(f"{where}.name: a device name is required, e.g. name: L40S")
    base = get(name) if known(name) else None
    peaks = _peaks(data.get("peak_flops") or {}, base, name, where)
    if data.get("memory_bandwidth") is None and base is None:
        raise DeviceError(f"{where}.memory_bandwidth is required for device {name!r}")
    nvlink = data.get("nvlink") or {}
    if not isinstance(nvlink, Mapping) or set(nvlink) - {"links", "link_bandwidth"}:
        raise DeviceError(f"{where}.nvlink: a mapping {{links: 18, link_bandwidth: 25GB/s}}")
    fallback = base or Device(name, peaks, 0.0)
    links = nvlink.get("links", fallback.nvlink_links)
    sms = data.get("sms", fallback.sms)
    for key, value in (("nvlink.links", links), ("sms", sms)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise DeviceError(f"{where}.{key}: a non-negative integer, got {value!r}")
    gb = data.get("memory_gb", fallback.memory / 1e9)
    if isinstance(gb, bool) or not isinstance(gb, int | float) or gb < 0:
        raise DeviceError(f"{where}.memory_gb: device memory in GB (0: unknown), got {gb!r}")
    arch = data.get("arch", fallback.arch)
    if arch not in ARCHS:
        raise DeviceError(f"{where}.arch: {arch!r} is not one of {', '.join(ARCHS)}")
    return Device(
        name,
        peaks,
        _rate_or(data, "memory_bandwidth", fallback.memory_bandwidth, where),
        links,
        _rate_or(nvlink, "link_bandwidth", fallback.nvlink_link_bandwidth, f"{where}.nvlink"),
        sms,
        arch,
        _rate_or(data, "pcie_bandwidth", fallback.pcie_bandwidth, where),
        float(gb) * 1e9,
    )


def _peaks(given: Any, base: Device | None, name: str, where: str) -> dict[str, float]:
    """The table's peaks (if any) with the described ones on top; fp32 is required."""
    if not isinstance(given, Mapping):
        raise DeviceError(f"{where}.peak_flops: a mapping such as {{fp32: 19.5TFLOPS}}")
    peaks = dict(base.peak_flops) if base else {}
    for precision, value in given.items():
        if precision not in PRECISIONS:
            raise DeviceError(
                f"{where}.peak_flops: {precision!r} is not one of {', '.join(PRECISIONS)}"
            )
        try:
            peaks[precision] = flop_rate(value, f"{where}.peak_flops.{precision}")
        except UnitError as exc:
            raise DeviceError(str(exc)) from None
    if "fp32" not in peaks:
        raise DeviceError(f"{where}.peak_flops.fp32 is required for device {name!r}")
    return peaks


def _rate_or(data: Mapping[str, Any], key: str, default: float, where: str) -> float:
    """``data[key]`` as bytes/s, or ``default`` when it is not given."""
    if data.get(key) is None:
        return default
    try:
        return bandwidth(data[key], f"{where}.{key}")
    except UnitError as exc:
        raise DeviceError(str(exc)) from None


def compute_seconds(
    flops: float, layers: int, device: Device, efficiency: float, precision: str
) -> float:
    """Forward+backward seconds of ``flops`` on ``device`` (see the module docstring)."""
    return flops / (device.peak(precision) * efficiency) + 2 * layers * LAUNCH_S


def optimizer_seconds(
    params: int, device: Device, bytes_per_param: float = OPTIMIZER_BYTES_PER_PARAM
) -> float:
    """Seconds of one optimizer update of ``params`` parameters (memory-bound)."""
    return params * bytes_per_param / (device.memory_bandwidth * MEMORY_EFFICIENCY)
