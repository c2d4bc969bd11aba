"""Parsing of bandwidths, latencies and sizes written the way people write them."""

from __future__ import annotations

import re

_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z/]*)\s*$", re.IGNORECASE)
_BITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_BYTES = {
    "b/s": 1,
    "bps": 1,
    "kb/s": 1e3,
    "kbps": 1e3,
    "mb/s": 1e6,
    "mbps": 1e6,
    "gb/s": 1e9,
    "gbps": 1e9,
    "tb/s": 1e12,
    "tbps": 1e12,
}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


class UnitError(ValueError):
    """A quantity that could not be read."""


def bandwidth(value: str | float | int, what: str = "bandwidth") -> float:
    """Bytes per second from ``100gbit``, ``25GB/s``, ``12.5mbps`` (tc: bytes/s) or a number
    (bytes/s)."""
    if isinstance(value, bool):
        raise UnitError(f"{what}: expected a rate such as 100gbit or 25GB/s, got {value!r}")
    if isinstance(value, int | float):
        number, unit = float(value), ""
    else:
        m = _RATE.match(str(value))
        if not m:
            raise UnitError(f"{what}: {value!r} is not a rate such as 100gbit, 25GB/s or 1e9")
        number, unit = float(m.group(1)), m.group(2).lower()
    if unit in _BITS:
        rate = number * _BITS[unit] / 8
    elif unit in _BYTES or unit == "":
        rate = number * _BYTES.get(unit, 1)
    else:
        raise UnitError(
            f"{what}: unknown unit {unit!r} in {value!r}; use bit/kbit/mbit/gbit, "
            "B/s, MB/s, GB/s (or tc's mbps = MB/s)"
        )
    if not rate > 0:
        raise UnitError(f"{what}: must be positive, got {value!r}")
    return rate


def duration(value: str | float | int, what: str = "latency") -> float:
    """Seconds from ``5us``, ``1.5ms``, ``0.01s`` or a number (seconds)."""
    if isinstance(value, bool):
        raise UnitError(f"{what}: expected a time such as 5us or 1ms, got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        m = _RATE.match(str(value))
        if not m or m.group(2).lower() not in _TIME:
            raise UnitError(f"{what}: {value!r} is not a time such as 5us, 1ms or 0.002")
        seconds = float(m.group(1)) * _TIME[m.group(2).lower()]
    if seconds < 0:
        raise UnitError(f"{what}: must not be negative, got {value!r}")
    return seconds


def human_rate(bytes_per_s: float) -> str:
    """2.5e10 -> '25 GB/s'; 1.25e7 -> '100 Mbit/s'."""
    if bytes_per_s < 1e9 / 8 * 10:
        return f"{bytes_per_s * 8 / 1e6:.4g} Mbit/s"
    return f"{bytes_per_s / 1e9:.4g} GB/s"


def human_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"
