"""Sharding stage 3's calibrated costs: the backend's all-gather and reduce-scatter corrected
against the alpha-beta rule, FSDP2's host work per step, unit and parameter tensor, fitted
from synthetic measurements and priced on CPU ranks only."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from longboat.sim import cluster as cluster_mod
from longboat.sim import cost
from longboat.sim.calibrate_fsdp import (
    SHAPES,
    SIZES,
    _step,
    collectives,
    host_work,
    nonnegative_lstsq,
    with_fsdp2,
)
from longboat.sim.cluster import AlgorithmCost, Fsdp2Cost
from longboat.sim.predict import simulate
from tests.sim.test_stage3 import EMBED, FC, GPU8, PROFILE, _stage3

CPU2 = cluster_mod.from_dict(
    {"nodes": 1, "devices_per_node": 2, "intra": {"kind": "loopback", "latency": "20us"}}
)
HOST = Fsdp2Cost(step_overhead=1e-3, unit_overhead=3e-3, param_overhead=5e-5, byte_overhead=1e-10)


def _report(host: Fsdp2Cost) -> dict:
    """Two ranks: an all-gather at 0.4 GB/s plus 300 us, a reduce-scatter at 0.25 GB/s plus
    200 us (bytes of the whole tensor), and FSDP2 steps costing ``host`` beyond what the
    corrected rule prices."""
    report = {
        "world": 2,
        "all_gather": {str(s): 3e-4 + s / 0.4e9 for s in SIZES},
        "reduce_scatter": {str(s): 2e-4 + s / 0.25e9 for s in SIZES},
    }
    corrected = dataclasses.replace(CPU2, collectives=collectives(CPU2, report))
    report["fsdp2"] = []
    for u, layers, width in SHAPES:
        step = _step(corrected, u, layers, width)
        moved = step.copied_bytes(True)
        priced = step.comm_s(True) + moved / corrected.mem_bw
        extra = priced + host.seconds(u, 2 * u * layers, moved)
        report["fsdp2"].append({"units": u, "layers": layers, "width": width, "extra_s": extra})
    return report


def test_corrections_reproduce_the_measured_collectives() -> None:
    fitted = with_fsdp2(CPU2, _report(HOST))
    for size in SIZES:
        gathered = sum(cost.all_gather_tensor(size / 2, fitted))
        assert gathered == pytest.approx(3e-4 + size / 0.4e9, rel=1e-6)
        scattered = sum(cost.reduce_scatter_tensor(size, fitted))
        assert scattered == pytest.approx(2e-4 + size / 0.25e9, rel=1e-6)
    # the uncorrected rule (half an allreduce) is far cheaper than this Gloo
    assert sum(cost.reduce_scatter_tensor(16 << 20, CPU2)) < 0.5 * (2e-4 + (16 << 20) / 0.25e9)


def test_host_work_is_fitted_beyond_what_the_rule_prices() -> None:
    fitted = with_fsdp2(CPU2, _report(HOST)).fsdp2
    assert fitted is not None
    assert fitted.step_overhead == pytest.approx(HOST.step_overhead, abs=1e-9)
    assert fitted.unit_overhead == pytest.approx(HOST.unit_overhead, rel=1e-6)
    assert fitted.param_overhead == pytest.approx(HOST.param_overhead, rel=1e-6)
    assert fitted.byte_overhead == pytest.approx(HOST.byte_overhead, rel=1e-6)


def test_a_negative_coefficient_is_held_at_zero() -> None:
    a = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    assert nonnegative_lstsq(a, np.array([3.0, 2.0, 1.0])) == pytest.approx([2.0, 0.0])
    corrected = with_fsdp2(CPU2, _report(HOST))
    host = host_work(corrected, _report(Fsdp2Cost(0.0, 2e-3, 0.0, 0.0)))
    assert dataclasses.astuple(host) == pytest.approx((0.0, 2e-3, 0.0, 0.0), abs=1e-9)


def test_cpu_ranks_pay_the_host_work_per_unit_and_parameter_gpus_do_not() -> None:
    """PROFILE: the root holds the embedding (1 tensor), 4 blocks 2 tensors each: 5 units
    holding parameters, 9 tensors; the root gathered once, the blocks twice, all scattered."""
    cpu4 = cluster_mod.from_dict({"nodes": 1, "devices_per_node": 4, "intra": {"kind": "loopback"}})
    bare = simulate(PROFILE, cpu4, _stage3())
    paid = simulate(PROFILE, dataclasses.replace(cpu4, fsdp2=HOST), _stage3())
    moved = EMBED + 2 * 4 * FC + EMBED + 4 * FC
    assert paid.host_overhead_s == pytest.approx(HOST.seconds(5, 9, moved))
    assert paid.step_s - bare.step_s == pytest.approx(HOST.seconds(5, 9, moved))
    assert bare.host_overhead_s == 0
    gpu = simulate(PROFILE, dataclasses.replace(GPU8, fsdp2=HOST), _stage3())
    assert gpu.host_overhead_s == 0


def test_the_reduce_scatter_correction_prices_stage_3() -> None:
    """Half the bandwidth and 1 ms per call: each of the 5 reduce-scatters (the root's and
    4 blocks') costs 1 ms more and its link time once more."""
    cpu4 = cluster_mod.from_dict({"nodes": 1, "devices_per_node": 4, "intra": {"kind": "loopback"}})
    slow = dataclasses.replace(cpu4, collectives={"reduce_scatter": AlgorithmCost(0.5, 1e-3)})
    before, after = simulate(PROFILE, cpu4, _stage3()), simulate(PROFILE, slow, _stage3())
    pieces = [EMBED] + [FC] * 4
    link = sum(cost.reduce_scatter_tensor(b, cpu4)[1] for b in pieces)
    assert after.comm_s - before.comm_s == pytest.approx(5 * 1e-3 + link)


def test_an_uncalibrated_cpu_cluster_says_what_is_not_priced() -> None:
    cpu4 = cluster_mod.from_dict({"nodes": 1, "devices_per_node": 4, "intra": {"kind": "loopback"}})
    note = "not calibrated on this cluster: FSDP2's host work per unit and Gloo's"
    assert any(note in n for n in simulate(PROFILE, cpu4, _stage3()).notes)
    fitted = with_fsdp2(CPU2, _report(HOST))
    assert not any("not calibrated" in n for n in simulate(PROFILE, fitted, _stage3()).notes)


def test_the_cluster_file_keeps_the_calibration(tmp_path) -> None:  # noqa: ANN001
    fitted = with_fsdp2(CPU2, _report(HOST))
    cluster_mod.save(fitted, tmp_path / "c.yaml")
    assert cluster_mod.load(tmp_path / "c.yaml") == fitted
    with pytest.raises(cluster_mod.ClusterError, match="'allgather' is not one of all_gather"):
        cluster_mod.from_dict({"nodes": 1, "devices_per_node": 2, "collectives": {"allgather": {}}})
    with pytest.raises(cluster_mod.ClusterError, match="fsdp2: unknown key"):
        cluster_mod.from_dict({"nodes": 1, "devices_per_node": 2, "fsdp2": {"per_unit": "1ms"}})


def test_recommend_never_offers_stage_3_where_memory_is_unknown() -> None:
    """CPU ranks (no device memory to exceed): stages 1 and 2 are tried, stage 3 is not, even
    on a cluster calibrated for it."""
    from longboat.sim.recommend import recommend

    fitted = with_fsdp2(CPU2, _report(HOST))
    choices = recommend(PROFILE, fitted, top=100, show=False)
    stages = {c.fields.get("sharding_configs", {}).get("stage") for c in choices}
    assert {1, 2} <= stages and 3 not in stages
