"""The cost model against hand-computed alpha-beta values."""

from __future__ import annotations

import math

import pytest

from longboat.sim import cost
from longboat.sim.cluster import AlgorithmCost, Cluster, Link

MB = 1 << 20


def make(nodes: int, per: int, **kw) -> Cluster:  # noqa: ANN003
    return Cluster(
        nodes=nodes,
        devices_per_node=per,
        intra=kw.pop("intra", Link(100e9, 2e-6, "nvlink")),
        inter=kw.pop("inter", Link(10e9, 10e-6)),
        memory_bandwidth=kw.pop("memory_bandwidth", 50e9),
        **kw,
    )


def test_ring_on_one_node_is_textbook() -> None:
    c = make(1, 4)
    lat, bw = cost.allreduce(64 * MB, c, "ring")
    assert lat == pytest.approx(2 * 3 * 2e-6)
    assert bw == pytest.approx(2 * 3 / 4 * 64 * MB / 100e9)


def test_native_has_log_latency_and_ring_bandwidth() -> None:
    c = make(1, 8)
    lat, bw = cost.allreduce(8 * MB, c, "native")
    assert lat == pytest.approx(2 * 3 * 2e-6)
    assert bw == pytest.approx(2 * 7 / 8 * 8 * MB / 100e9)


def test_flat_ring_across_nodes_is_limited_by_the_nic() -> None:
    c = make(2, 4, inter=Link(10e9, 10e-6, nics_per_node=2))
    lat, bw = cost.allreduce(MB, c, "ring")
    assert lat == pytest.approx(2 * 7 * 10e-6)
    assert bw == pytest.approx(2 * 7 / 8 * MB / min(100e9, 2 * 10e9))


def test_hierarchical_sends_a_shard_per_nic() -> None:
    c = make(4, 2)  # nvlink intra: ring reduce-scatter and all-gather of 2 ranks
    s = 16 * MB
    lat, bw = cost.allreduce(s, c, "hierarchical")
    intra_lat, intra_bw = 1 * 2e-6, 0.5 * s / 100e9
    inter_lat, inter_bw = 2 * 2 * 10e-6, 2 * 3 / 4 * (s / 2) / (10e9 * 1 / 2)
    assert lat == pytest.approx(2 * intra_lat + inter_lat)
    assert bw == pytest.approx(2 * intra_bw + inter_bw)


def test_hierarchical_on_cpu_uses_shared_memory_stages() -> None:
    c = make(2, 2, intra=Link(2e9, 20e-6, "loopback"), shm_passes=2.0)
    s = 4 * MB
    _, bw = cost.allreduce(s, c, "hierarchical")
    shm = 2.0 * s * 2 / 50e9
    inter = 1 / 2 * (s / 2) / (10e9 / 2) * 2
    assert bw == pytest.approx(2 * shm + inter)


def test_shm_is_memory_bound_and_one_node_only() -> None:
    c = make(1, 4, intra=Link(2e9, 20e-6, "shm"))
    assert cost.allreduce(MB, c, "shm") == pytest.approx((0.0, 3.0 * MB * 4 / 50e9))
    with pytest.raises(cost.CostError, match="does not apply"):
        cost.allreduce(MB, make(2, 4), "shm")


def test_calibrated_corrections_apply() -> None:
    c = make(1, 2, algorithms={"ring": AlgorithmCost(0.5, 1e-3)})
    lat, bw = cost.allreduce(MB, c, "ring")
    assert lat == pytest.approx(2 * 2e-6 + 1e-3)
    assert bw == pytest.approx(MB / 100e9 / 0.5)


def test_one_rank_costs_nothing_and_allgather_scales_with_peers() -> None:
    assert cost.allreduce(MB, make(1, 1), "native") == (0.0, 0.0)
    lat, bw = cost.allgather(1000, make(1, 4))
    assert (lat, bw) == pytest.approx((3 * 2e-6, 3 * 1000 / 100e9))


def test_log2() -> None:
    assert [cost._log2(n) for n in (1, 2, 3, 4, 4096)] == [0, 1, 2, 2, int(math.log2(4096))]


def test_a_registered_algorithm_simulates_from_its_declared_cost() -> None:
    """One file adds an algorithm that trains and simulates: the simulator asks the registry
    for its cost model (here: twice a ring's link time), never a list of its own."""
    from longboat.comm.algorithms import Network, register
    from longboat.registry import ALGORITHMS
    from longboat.sim.predict import simulate
    from longboat.strategy import Strategy
    from tests.sim.helpers import linear_profile

    def slow_ring(nbytes: float, net: Network) -> tuple[float, float]:
        lat, link = net.flat(nbytes, "ring")
        return lat, 2 * link

    cpu = make(2, 2, intra=Link(2e9, 20e-6, "loopback"))
    with ALGORITHMS.scoped():

        @register("slow_ring", cost=slow_ring)
        def make_slow_ring(group):  # noqa: ANN001, ANN202 - never built here
            raise AssertionError

        @register("unmodelled")
        def make_unmodelled(group):  # noqa: ANN001, ANN202
            raise AssertionError

        ring_parts = cost.allreduce(8 * MB, cpu, "ring")
        assert cost.allreduce(8 * MB, cpu, "slow_ring") == pytest.approx(
            (ring_parts[0], 2 * ring_parts[1])
        )
        assert cost.applicable("slow_ring", cpu) and not cost.applicable("unmodelled", cpu)
        assert cost.best_algorithm(8 * MB, cpu) != "slow_ring"
        prof = linear_profile([1024] * 4)
        slow = simulate(prof, cpu, Strategy(allreduce_algorithm="slow_ring"))
        assert slow.step_s > simulate(prof, cpu, Strategy(allreduce_algorithm="ring")).step_s
        with pytest.raises(cost.CostError, match="declares no cost model.*cost="):
            cost.allreduce(8 * MB, cpu, "unmodelled")
    assert "slow_ring" not in ALGORITHMS


def test_auto_on_one_cpu_node_names_shm() -> None:
    """The simulator's 'auto' tries what longboat's automatic choice tries: on one node not
    hierarchical (declared for several nodes), which costs there what shm costs."""
    cpu = make(1, 4, intra=Link(2e9, 20e-6, "loopback"))
    assert cost.allreduce(1e3, cpu, "shm") == cost.allreduce(1e3, cpu, "hierarchical")
    assert cost.best_algorithm(1e3, cpu) == "shm"
