"""Calibration fits recover the parameters of synthetic measurements."""

from __future__ import annotations

import sys

import pytest

from longboat.sim import cost
from longboat.sim.calibrate import fit, local_cluster, with_emulated_link

MODULE = sys.modules["longboat.sim.calibrate"]  # the package's `calibrate` is the function

SIZES = (1 << 16, 1 << 20, 4 << 20, 16 << 20)


def test_fit_recovers_a_line() -> None:
    a, b = fit({s: 1e-4 + s / 1e9 for s in SIZES})
    assert a == pytest.approx(1e-4, rel=1e-6) and b == pytest.approx(1e-9, rel=1e-6)


def _report(native_rate: float, ring_rate: float) -> dict:
    def rows(alpha: float, rate: float) -> dict:
        return {str(s): {"seconds": alpha + s / rate} for s in SIZES}

    return {
        "world_size": 2,
        "memcpy_GBps": 10.0,
        "results": {
            "gloo": rows(2e-4, native_rate),
            "native": rows(2e-4, native_rate),
            "ring": rows(1e-3, ring_rate),
            "shm": rows(5e-5, 5e9),
        },
    }


def test_local_cluster_from_bench_report(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(MODULE, "effective_cores", lambda: 2.0)
    c = local_cluster(_report(1e9, 5e8))
    assert c.intra.rate == pytest.approx(1e9) and c.intra.latency == pytest.approx(1e-4)
    assert c.cost("ring").bandwidth_efficiency == pytest.approx(0.5)
    assert c.cost("ring").overhead == pytest.approx(1e-3 - 2e-4)
    assert c.shm_passes * 2 / c.mem_bw == pytest.approx(1 / 5e9)
    # the fitted model reproduces the measurement it came from
    assert sum(cost.allreduce(4 << 20, c, "ring")) == pytest.approx(1e-3 + (4 << 20) / 5e8)


def test_emulated_link(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(MODULE, "effective_cores", lambda: 2.0)
    local = local_cluster(_report(1e9, 5e8))
    report = {
        "link": {str(s): 2e-4 + s / 0.95e8 for s in SIZES},
        "hierarchical": {str(s): 1e-3 + s / 0.9e8 for s in SIZES},
        "world": 4,
        "nodes": 2,
    }
    c = with_emulated_link(local, report, "800mbit")
    assert (c.nodes, c.devices_per_node) == (2, 2)
    assert c.inter.efficiency == pytest.approx(0.95) and c.inter.latency == pytest.approx(1e-4)
    measured = 1e-3 + (2 << 20) / 0.9e8
    assert sum(cost.allreduce(2 << 20, c, "hierarchical")) == pytest.approx(measured, rel=1e-3)
