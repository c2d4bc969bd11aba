"""Rates say bits or bytes by the case of b/B, as vendors write them; ambiguity is refused."""

from __future__ import annotations

import pytest

from longboat.sim.units import UnitError, bandwidth, duration, flop_rate, rate_text

GBIT = 1e9 / 8


@pytest.mark.parametrize(
    ("text", "bytes_per_s"),
    [
        ("100Gb/s", 100 * GBIT),
        ("100 Gb/s", 100 * GBIT),
        ("100Gbit/s", 100 * GBIT),
        ("100 Gbit/s", 100 * GBIT),
        ("100Gbps", 100 * GBIT),
        ("100 Gbps", 100 * GBIT),
        ("100gbit", 100 * GBIT),
        ("100Gbit", 100 * GBIT),
        ("100 Gbits/s", 100 * GBIT),
        ("400Mb/s", 400e6 / 8),
        ("400 Mbps", 400e6 / 8),
        ("100mbit", 100e6 / 8),
        ("1.6Tb/s", 1.6e12 / 8),
        ("1 Tbps", 1e12 / 8),
        ("64kbit", 64e3 / 8),
        ("25GB/s", 25e9),
        ("25 GB/s", 25e9),
        ("25GBps", 25e9),
        ("900 MB/s", 900e6),
        ("2TB/s", 2e12),
        ("12 GiB/s", 12 * 2**30),
        ("5e9 B/s", 5e9),
        ("8 b/s", 1.0),
        ("3 bytes/s", 3.0),
    ],
)
def test_accepted_spellings(text: str, bytes_per_s: float) -> None:
    assert bandwidth(text) == pytest.approx(bytes_per_s)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("100gbps", "ambiguous"),  # tc reads this as gigabytes, vendors as gigabits
        ("10 gb/s", "ambiguous"),
        ("12.5mbps", "ambiguous"),
        ("100 mB/s", "ambiguous"),
        ("100", "no unit"),
        (100, "bare number"),
        (12.5e9, "bare number"),
        (True, "bare number"),
        ("100 G", "unknown unit"),
        ("10 parsecs", "unknown unit"),
        ("fast", "not a rate"),
        ("0 Gb/s", "positive"),
    ],
)
def test_refusals_name_the_accepted_forms(value: object, message: str) -> None:
    with pytest.raises(UnitError, match=message) as exc:
        bandwidth(value, "inter.bandwidth")  # type: ignore[arg-type]
    text = str(exc.value)
    assert text.startswith("inter.bandwidth")
    if message != "positive":
        assert "100 Gbit/s" in text and "25 GB/s" in text


def test_rate_text_reads_back_exactly() -> None:
    for rate in (12.5e9, 1 / 3 * 1e9, 123456789.123):
        assert bandwidth(rate_text(rate)) == rate


@pytest.mark.parametrize(
    ("text", "flops"),
    [("312TFLOPS", 312e12), ("312 TFLOP/s", 312e12), ("19.5T", 19.5e12), (1e12, 1e12),
     ("1.2PFLOPS", 1.2e15), ("900 GFLOPS", 900e9)],
)  # fmt: skip
def test_flop_rates(text: object, flops: float) -> None:
    assert flop_rate(text) == pytest.approx(flops)  # type: ignore[arg-type]


def test_flop_rate_refusals() -> None:
    for bad in ("312 TB/s", "fast", -1, "0T"):
        with pytest.raises(UnitError):
            flop_rate(bad)  # type: ignore[arg-type]


def test_durations() -> None:
    assert duration("5us") == pytest.approx(5e-6)
    assert duration("1.5ms") == pytest.approx(1.5e-3)
    assert duration(0.002) == 0.002
    with pytest.raises(UnitError):
        duration("soon")
