"""Parsing of bandwidths, FLOP rates, latencies and sizes written the way people write them.

Rates keep bits and bytes apart by the case of ``b``/``B``, as vendors write them:
``100 Gb/s``, ``100 Gbit/s``, ``100 Gbps`` and ``100gbit`` are gigabits per second;
``25 GB/s`` and ``25 GBps`` are gigabytes per second. A spelling whose meaning hangs on a case
that was not written (``100gbps``, ``10 gb/s``, a bare number) is refused, naming these forms (tc's own spellings, where ``mbps`` means megabytes, are read
by `longboat emulate`, not here).
"""

from __future__ import annotations

import re

_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"
_QUANTITY = re.compile(rf"^\s*{_NUMBER}\s*(\S*)\s*$")
_DECIMAL = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_BINARY = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}
_SPELLED_BITS = re.compile(r"^([kmgt]?)bits?(?:/s|ps)?$", re.IGNORECASE)
_SPELLED_BYTES = re.compile(r"^([kmgt]?)bytes?(?:/s)?$", re.IGNORECASE)
_SYMBOL = re.compile(r"^(Ki|Mi|Gi|Ti|[kKMGT]?)([bB])(?:/s|ps)$")
_LOOSE_SYMBOL = re.compile(r"^([kmgt]i?)?b(?:/s|ps)$", re.IGNORECASE)
_FLOPS = re.compile(r"^([kKMGTP]?)(?:flop/s|flops)?$", re.IGNORECASE)
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}

RATE_FORMS = (
    "bits: 100 Gbit/s, 100 Gb/s, 100 Gbps or 100gbit; bytes: 25 GB/s or 25 GBps "
    "(k/K, M, G, T prefixes; the case of b/B decides bits or bytes)"
)


class UnitError(ValueError):
    """A quantity that could not be read."""


def _spelled(letter: str) -> float:
    """The scale of a prefix before a spelled-out unit (``Gbit``, ``gbit``: any case)."""
    return {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}[letter.lower()]


def _rate_unit(unit: str) -> float | None:
    """Bytes/s per unit of ``unit``, or None when the spelling is not accepted."""
    if m := _SPELLED_BITS.match(unit):
        return _spelled(m.group(1)) / 8
    if m := _SPELLED_BYTES.match(unit):
        return _spelled(m.group(1))
    if m := _SYMBOL.match(unit):
        scale = _BINARY.get(m.group(1)) or _DECIMAL[m.group(1)]
        return scale / 8 if m.group(2) == "b" else scale
    return None


def bandwidth(value: str | float | int, what: str = "bandwidth") -> float:
    """Bytes per second from a rate with its unit (see the module docstring)."""
    forms = RATE_FORMS
    if isinstance(value, int | float):  # bool too
        raise UnitError(
            f"{what}: a bare number ({value!r}) does not say bits or bytes; write {forms}"
        )
    m = _QUANTITY.match(str(value))
    if not m:
        raise UnitError(f"{what}: {value!r} is not a rate; write {forms}")
    number, unit = float(m.group(1)), m.group(2)
    if not unit:
        raise UnitError(f"{what}: {value!r} has no unit (bits or bytes?); write {forms}")
    per_unit = _rate_unit(unit)
    if per_unit is None and _LOOSE_SYMBOL.match(unit):
        raise UnitError(
            f"{what}: {value!r} is ambiguous: in {unit!r} the case of the prefix or of b/B "
            f"does not say bits or bytes (tc reads 'mbps' as megabytes); write {forms}"
        )
    if per_unit is None:
        raise UnitError(f"{what}: unknown unit {unit!r} in {value!r}; write {forms}")
    rate = number * per_unit
    if not rate > 0:
        raise UnitError(f"{what}: must be positive, got {value!r}")
    return rate


def flop_rate(value: str | float | int, what: str = "peak FLOP/s") -> float:
    """FLOP/s from ``312TFLOPS``, ``312 TFLOP/s``, ``312T`` or a number (FLOP/s)."""
    if isinstance(value, bool):
        raise UnitError(f"{what}: expected a FLOP rate such as 312TFLOPS, got {value!r}")
    if isinstance(value, int | float):
        rate = float(value)
    else:
        m = _QUANTITY.match(str(value))
        unit = _FLOPS.match(m.group(2)) if m else None
        if not m or not unit:
            raise UnitError(
                f"{what}: {value!r} is not a FLOP rate such as 312TFLOPS, 312 TFLOP/s or 3.12e14"
            )
        rate = float(m.group(1)) * _spelled(unit.group(1))
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
        m = _QUANTITY.match(str(value))
        if not m or m.group(2).lower() not in _TIME:
            raise UnitError(f"{what}: {value!r} is not a time such as 5us, 1ms or 0.002")
        seconds = float(m.group(1)) * _TIME[m.group(2).lower()]
    if seconds < 0:
        raise UnitError(f"{what}: must not be negative, got {value!r}")
    return seconds


def rate_text(bytes_per_s: float) -> str:
    """A rate as :func:`bandwidth` reads it back exactly: 2.5e10 -> '25000000000.0 B/s'."""
    return f"{float(bytes_per_s)!r} B/s"


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
