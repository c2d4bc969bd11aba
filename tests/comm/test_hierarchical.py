"""hierarchical: equals dist.all_reduce on emulated nodes, any size; clear errors."""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.distributed as dist

from longboat.cluster.topology import Topology
from longboat.comm.algorithms.hierarchical import HierarchicalError, plan_nodes, shard_bounds
from tests._dist import join_as_emulated_nodes, run_ranks

SIZES = (0, 1, 3, 7, 1023, 100_003)
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)


def _check(group, rank: int, label: str, failures: list[str], digests: dict[str, str], fn) -> None:
    for numel in SIZES:
        for dtype in DTYPES if numel < 100_000 else (torch.float32, torch.int64):
            g = torch.Generator().manual_seed(numel * 7 + rank)
            x = torch.randint(-8, 9, (numel,), generator=g).to(dtype)  # exact sums
            expected = x.clone()
            dist.all_reduce(expected, group=group)
            fn(x).wait()
            if not torch.equal(x, expected):
                failures.append(f"{label} {numel}/{dtype}: differs from dist.all_reduce")
    x = torch.randn(12_345, generator=torch.Generator().manual_seed(rank))
    expected = x.double()
    dist.all_reduce(expected, group=group)
    fn(x).wait()
    if not torch.allclose(x.double(), expected, rtol=1e-5, atol=1e-5):
        failures.append(f"{label} random float32: far from the float64 sum")
    digests[label] = hashlib.sha256(x.numpy().tobytes()).hexdigest()
    base = torch.arange(35.0).view(5, 7) + rank
    expected = base.t().clone()
    dist.all_reduce(expected, group=group)
    fn(base.t()).wait()
    if not torch.equal(base.t(), expected):
        failures.append(f"{label} non-contiguous: differs from dist.all_reduce")


def _exercise(group, rank: int, variants: list[dict]) -> dict:
    """Every variant against dist.all_reduce on ``group``; then two bad inter_nranks."""
    from longboat.comm.algorithms.hierarchical import make_hierarchical

    failures: list[str] = []
    digests: dict[str, str] = {}
    shapes = {}
    for kwargs in variants:
        label = ",".join(f"{k}={v}" for k, v in kwargs.items()) or "default"
        fn = make_hierarchical(group, **kwargs)
        # (ranks in the intra-node stage, has an inter-node stage)
        shapes[label] = (
            None if fn.state.intra is None else fn.state.intra.size,
            bool(fn.state.inter),
        )
        _check(group, rank, label, failures, digests, fn)
        fn.close()
    world, errors = dist.get_world_size(group), []
    for bad in (world - 1, 0):  # world - 1 divides no group of 3+ ranks
        try:
            make_hierarchical(group, inter_nranks=bad)
        except HierarchicalError as exc:
            errors.append(str(exc))
    return {"failures": failures, "digests": digests, "shapes": shapes, "errors": errors}


def _on_world(rank: int, world: int, ranks_per_node: int, variants: list[dict]) -> dict:
    join_as_emulated_nodes(rank, ranks_per_node, world)
    return _exercise(dist.group.WORLD, rank, variants)


def _verify(results: list[dict]) -> dict:
    world = len(results)
    for rank, res in enumerate(results):
        assert res["failures"] == [], f"rank {rank}: {res['failures']}"
        assert len(res["errors"]) == 2, f"rank {rank}: a bad inter_nranks was accepted"
        assert (
            f"hierarchical_allreduce_inter_nranks={world - 1} does not divide" in res["errors"][0]
        )
    assert all(res["digests"] == results[0]["digests"] for res in results)
    return results[0]["shapes"]


def test_two_nodes_of_two() -> None:
    results = run_ranks(_on_world, 4, 2, [{}, {"inter": "ring"}, {"inter_nranks": 2}], timeout=120)
    assert set(_verify(results).values()) == {(2, True)}


def test_one_node_of_four_and_virtual_nodes() -> None:
    variants = [{}, {"inter_nranks": 2}, {"inter_nranks": 1}]
    shapes = _verify(run_ranks(_on_world, 4, 4, variants, timeout=120))
    assert shapes == {
        "default": (4, False),
        "inter_nranks=2": (2, True),
        "inter_nranks=1": (None, True),
    }


def _subgroups(rank: int, world: int) -> dict:
    """Groups of 3 and 4 of 5 ranks: only members call the factory."""
    join_as_emulated_nodes(rank, world, world)
    three, four = dist.new_group([0, 1, 2]), dist.new_group([0, 1, 2, 3])
    out: dict = {}
    if rank < 3:  # one level only: runs on the group itself, no new groups needed
        out["three"] = _exercise(three, rank, [{}, {"inter_nranks": 1, "inter": "ring"}])
    if rank < 4:  # two levels would need groups that rank 4 must help create
        from longboat.comm.algorithms.hierarchical import make_hierarchical

        try:
            make_hierarchical(four, inter_nranks=2)
        except HierarchicalError as exc:
            out["four"] = str(exc)
    return out


@pytest.mark.slow  # slow tier: another spawn of 3 ranks
def test_one_node_of_three_and_groups_smaller_than_the_world() -> None:
    results = run_ranks(_subgroups, 5, timeout=120)
    assert results[4] == {}
    shapes = _verify([r["three"] for r in results[:3]])
    assert shapes == {"default": (3, False), "inter_nranks=1,inter=ring": (None, True)}
    for r in results[:4]:
        assert "over 4 of 5 ranks needs new intra- and inter-node groups" in r["four"]


def test_plan_nodes_follows_topology_and_rejects_bad_layouts() -> None:
    interleaved = Topology((0, 1, 0, 1), 0)
    assert plan_nodes([0, 1, 2, 3], interleaved, None) == [[0, 2], [1, 3]]
    assert plan_nodes([0, 1, 2, 3], interleaved, 2) == [[0, 2], [1, 3]]
    assert plan_nodes([0, 1, 2, 3], interleaved, 4) == [[0, 1, 2, 3]]
    with pytest.raises(HierarchicalError, match="=3 does not divide the 4 ranks"):
        plan_nodes([0, 1, 2, 3], interleaved, 3)
    uneven = Topology((0, 0, 1), 0)
    with pytest.raises(HierarchicalError, match="same number of ranks on every node"):
        plan_nodes([0, 1, 2], uneven, None)
    with pytest.raises(HierarchicalError, match="inter_nranks=1 cannot match"):
        plan_nodes([0, 1, 2], uneven, 1)


def test_shard_bounds_cover_any_size() -> None:
    assert shard_bounds(7, 2) == [(0, 4), (4, 7)]
    assert shard_bounds(1, 4) == [(0, 1), (1, 1), (1, 1), (1, 1)]
    assert shard_bounds(0, 3) == [(0, 0)] * 3


def test_strategy_inter_nranks_only_when_set() -> None:
    import longboat as lb
    from longboat.collective.plan import Placement, resolve_comm
    from longboat.comm import algorithms
    from longboat.comm.algorithms.hierarchical import make_hierarchical

    placement = Placement.of([0, 0, 1, 1], "gloo")
    assert dict(resolve_comm(lb.Strategy(), placement).options) == {}
    chosen = lb.Strategy(hierarchical_allreduce_inter_nranks=8)
    options = resolve_comm(chosen, placement).options
    assert dict(options) == {"inter_nranks": 8}
    # each factory gets the options it names; one taking **options gets them all
    assert algorithms._taken_by(make_hierarchical, options) == {"inter_nranks": 8}
    assert algorithms._taken_by(lambda group: group, options) == {}
    assert algorithms._taken_by(lambda group, **kw: kw, options) == {"inter_nranks": 8}
