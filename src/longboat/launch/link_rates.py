"""Link rates and latencies as `longboat emulate` takes them and `tc` reads them, and the tbf
bucket a rate needs."""

from __future__ import annotations

import re

#: Burst floor: one full GSO/TSO packet (64 KiB), so veth's super-packets pass unsplit.
MIN_BURST_BYTES = 64 * 1024
#: Burst covers this much traffic at the configured rate (timer slack at high rates).
BURST_SECONDS = 0.001

_RATE_UNITS = {
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
    "bps": 8,
    "kbps": 8 * 10**3,
    "mbps": 8 * 10**6,
    "gbps": 8 * 10**9,
    "tbps": 8 * 10**12,
}
_TIME_UNITS = {"us": 1e-6, "usec": 1e-6, "ms": 1e-3, "msec": 1e-3, "s": 1.0, "sec": 1.0}


def parse_rate(text: str) -> int:
    """``1gbit`` / ``100mbit`` / ``12.5mbps`` (bytes) / bare bits -> bits per second, as tc reads them."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or (unit and unit not in _RATE_UNITS):
        raise ValueError(
            f"bandwidth {text!r} is not a rate; write a number with one of "
            f"{', '.join(_RATE_UNITS)} (tc's units: 'bit' for bits, 'bps' for bytes per second), "
            "e.g. 1gbit"
        )
    bits = float(match.group(1)) * _RATE_UNITS[unit or "bit"]
    if bits < 8000:
        raise ValueError(f"bandwidth {text!r} is below 8kbit; tbf cannot shape that slowly")
    return int(bits)


def parse_latency(text: str) -> float:
    """``10ms`` / ``500us`` / ``0.1s`` -> seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*", text)
    if not match or match.group(2).lower() not in _TIME_UNITS:
        raise ValueError(f"latency {text!r} is not a duration; write e.g. 10ms, 500us or 0.1s")
    return float(match.group(1)) * _TIME_UNITS[match.group(2).lower()]


def format_rate(bps: int) -> str:
    """Bits per second as a short human string (1gbit, 250mbit, 8kbit ...)."""
    for unit, size in (("tbit", 10**12), ("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bps >= size and bps % size == 0:
            return f"{bps // size}{unit}"
    return f"{bps}bit"


def burst_for(rate_bps: int) -> int:
    """tbf bucket size: max(64 KiB, 1 ms of traffic at the rate) bytes."""
    return max(MIN_BURST_BYTES, int(rate_bps / 8 * BURST_SECONDS))
