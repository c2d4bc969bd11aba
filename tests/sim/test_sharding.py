"""longboat sim with sharding: a reduce-scatter in place of the allreduce (stage 2), the
optimizer on 1/d of the elements, the parameters' all-gather during the next forward, memory
per rank."""

from __future__ import annotations

import pytest

from longboat.sim import cluster as cluster_mod
from longboat.sim import cost
from longboat.sim.predict import simulate
from longboat.strategy import Strategy
from tests.sim.helpers import linear_profile

EIGHT = cluster_mod.from_dict(
    {"nodes": 2, "devices_per_node": 4, "inter": {"bandwidth": "10gbit", "latency": "50us"}}
)
PROFILE = linear_profile([1024] * 9, backward_s=0.05)
PARAM_BYTES = sum(p.nbytes for p in PROFILE.params)


def _sharded(stage: int, degree: int = 0) -> Strategy:
    return Strategy(sharding=True, sharding_configs={"stage": stage, "sharding_degree": degree})


def test_stage_1_adds_the_parameter_all_gather_and_splits_the_optimizer() -> None:
    plain, stage1 = simulate(PROFILE, EIGHT), simulate(PROFILE, EIGHT, _sharded(1))
    lat, link = cost.allgather(PARAM_BYTES / 8, EIGHT)
    assert stage1.bytes_sent - plain.bytes_sent == 7 * PARAM_BYTES // 8
    waited = stage1.exposed_comm_s - plain.exposed_comm_s
    assert 0 < waited < lat + link  # the next forward hides part of the gather
    assert stage1.comm_s - plain.comm_s >= lat + link  # one gather per bucket: more latency
    assert stage1.optimizer_s == pytest.approx(plain.optimizer_s / 8)
    assert any("sharding stage 1 over 8 ranks" in n for n in stage1.notes)


def test_stage_2_reduce_scatters_the_buckets() -> None:
    stage1, stage2 = simulate(PROFILE, EIGHT, _sharded(1)), simulate(PROFILE, EIGHT, _sharded(2))
    gathered = 7 * PARAM_BYTES // 8
    assert stage2.bytes_sent - gathered == pytest.approx((stage1.bytes_sent - gathered) / 2, abs=64)
    assert stage2.step_s <= stage1.step_s


def test_memory_per_rank_follows_the_stage_and_the_degree() -> None:
    plain = simulate(PROFILE, EIGHT).memory
    assert plain == {
        "parameters": PARAM_BYTES,
        "gradients": PARAM_BYTES,
        "optimizer_state": 2 * PARAM_BYTES,
    }
    assert simulate(PROFILE, EIGHT, _sharded(1)).memory["optimizer_state"] == 2 * PARAM_BYTES // 8
    assert simulate(PROFILE, EIGHT, _sharded(2)).memory["gradients"] == PARAM_BYTES // 8
    within_nodes = simulate(PROFILE, EIGHT, _sharded(2, degree=4)).memory
    assert within_nodes["optimizer_state"] == 2 * PARAM_BYTES // 4
    assert within_nodes["gradients"] == PARAM_BYTES // 4


def test_a_degree_that_does_not_divide_the_world_is_refused() -> None:
    with pytest.raises(ValueError, match="sharding_degree"):
        simulate(PROFILE, EIGHT, _sharded(1, degree=3))


def test_recommend_proposes_sharding_when_the_state_does_not_fit() -> None:
    """24 layers 4096 wide: 403 M float32 parameters, 6.4 GB of model state per rank with Adam
    unsharded, 3.6 GB at stage 1 over 8 ranks, 2.2 GB at stage 2. Cards of 4 GB (80 %: 3.2 GB
    for the state) leave only stage 2; cards of 1 GB nothing, and the error says so."""
    from longboat.sim.recommend import recommend

    big = linear_profile([4096] * 25, backward_s=0.5)
    small_cards = cluster_mod.from_dict(
        {
            "nodes": 1,
            "devices_per_node": 8,
            "device": {"name": "A10", "memory_gb": 4},
        }
    )
    choices = recommend(big, small_cards, top=50, show=False)
    assert choices and all(c.fields.get("sharding") for c in choices)
    assert {c.fields["sharding_configs"]["stage"] for c in choices} == {2}
    tiny_cards = cluster_mod.from_dict(
        {"nodes": 1, "devices_per_node": 8, "device": {"name": "A10", "memory_gb": 1}}
    )
    with pytest.raises(ValueError, match="no Strategy tried fits.*GB of a A10"):
        recommend(big, tiny_cards, show=False)


def test_the_forward_waits_for_the_first_bucket_and_hides_the_rest() -> None:
    from longboat.sim.sharding import Sharded

    shard = Sharded(stage=1, degree=8, group=EIGHT, gather_bytes=0)
    sizes = [4 << 20, 4 << 20, 1 << 20]
    gathers = [shard.gather_s(n) for n in sizes]
    assert shard.exposed_gather(sizes, 0.0) == pytest.approx(sum(gathers))  # nothing to hide
    assert shard.exposed_gather(sizes, 100.0) == pytest.approx(gathers[0])  # all but the first
    some = shard.exposed_gather(sizes, sum(gathers) / 2)
    assert gathers[0] < some < sum(gathers)


def test_calibrated_backend_collectives_price_stages_1_and_2_across_nodes() -> None:
    """Across nodes the shard group runs the backend's reduce-scatter and all-gather, priced
    with the cluster's calibrated corrections (Gloo's reduce-scatter is no half allreduce on
    CPU ranks); within one Gloo node longboat's shared-memory ones, uncorrected."""
    import dataclasses

    from longboat.sim.cluster_types import AlgorithmCost
    from longboat.sim.sharding import Sharded

    slow = {
        "reduce_scatter": AlgorithmCost(bandwidth_efficiency=0.5, overhead=1e-3),
        "all_gather": AlgorithmCost(bandwidth_efficiency=0.25),
    }
    across = dataclasses.replace(EIGHT, backend="gloo", collectives=slow)
    within = dataclasses.replace(across, nodes=1, devices_per_node=8)
    allreduce = (0.010, 0.100)
    for group, expected in ((across, (0.005 + 1e-3, 0.100)), (within, (0.005, 0.050))):
        stage2 = Sharded(stage=2, degree=8, group=group, gather_bytes=0)
        assert stage2.collective(allreduce) == pytest.approx(expected)
        assert Sharded(stage=1, degree=8, group=group, gather_bytes=0).collective(allreduce) == (
            allreduce
        )
    lat, link = cost.allgather((1 << 20) / 8, across)
    gather = Sharded(stage=1, degree=8, group=across, gather_bytes=0).gather_s(1 << 20)
    assert gather == pytest.approx(lat + link / 0.25)
    lat, link = cost.allgather((1 << 20) / 8, within)
    assert Sharded(stage=1, degree=8, group=within, gather_bytes=0).gather_s(1 << 20) == (
        pytest.approx(lat + link)
    )
