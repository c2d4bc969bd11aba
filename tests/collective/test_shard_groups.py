"""Sharding's collectives through shared memory: reduce-scatter, all-gather and the sum over
replicas equal Gloo's on 4 ranks (shard groups of 4 and of 2), for float32, bfloat16, float16
and int32, uneven sizes padded to equal slices, one piece and many; the handles wait and chain
like Gloo's; an all-gather straight into slices cut over many parameters gives the bucket,
and writes nothing once its gate closes; groups spread over nodes stay on Gloo. One spawn for
all."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_ranks

WORLD = 4
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int32)
SIZES = (1, 5, 1023, 5003, 70_001)  # bucket elements: most not a multiple of the degree
PIECE = 4096  # bytes: the "pieces" groups cut every collective into many


def _inputs(n: int, dtype: torch.dtype, rank: int, integral: bool) -> torch.Tensor:
    """Global rank ``rank``'s bucket; integral values sum exactly in any order."""
    g = torch.Generator().manual_seed(n * 31 + DTYPES.index(dtype) * 7 + rank * 2 + integral)
    if integral or not dtype.is_floating_point:
        return torch.randint(-20, 20, (n,), generator=g).to(dtype)
    return torch.randn(n, generator=g).to(dtype)


def _padded(n: int, dtype: torch.dtype, rank: int, integral: bool, degree: int) -> torch.Tensor:
    """The bucket padded with zeros to ``degree`` equal slices, as the sharded reducer packs it."""
    full = torch.zeros(math.ceil(n / degree) * degree, dtype=dtype)
    full[:n] = _inputs(n, dtype, rank, integral)
    return full


def _rank_order(members: list[int], *bucket: Any) -> torch.Tensor:
    """The group's padded buckets (``_padded(*bucket)`` of each member) summed in group-rank
    order, as the shm collectives add."""
    n, dtype, integral, degree = bucket
    out = _padded(n, dtype, members[0], integral, degree) + _padded(
        n, dtype, members[1], integral, degree
    )
    for r in members[2:]:
        out += _padded(n, dtype, r, integral, degree)
    return out


def _check_reduce_scatter(groups: Any, rank: int, tag: str) -> list[str]:
    bad = []
    for dtype in DTYPES:
        for n in SIZES:
            for integral in (True, False):
                what = f"{tag} degree {groups.degree} {dtype} n={n} integral={integral}"
                bad += [f"reduce-scatter {what}: {e}" for e in _reduce_scatter_once(
                    groups, rank, (n, dtype, integral, groups.degree)
                )]  # fmt: skip
    return bad


def _reduce_scatter_once(groups: Any, rank: int, bucket: tuple) -> list[str]:
    """One bucket reduce-scattered through ``groups`` and through Gloo."""
    from longboat.comm.handles import wait_for

    n, dtype, integral, degree = bucket
    members = dist.get_process_group_ranks(groups.shard)
    full = _padded(n, dtype, rank, integral, degree)
    m = full.numel() // degree
    out = torch.empty(m, dtype=dtype)
    wait_for(groups.reduce_scatter(out, full))
    gloo = torch.empty(m, dtype=dtype)
    dist.reduce_scatter_tensor(gloo, full.clone(), group=groups.shard)
    bad = []
    order = _rank_order(members, *bucket)[groups.index * m : (groups.index + 1) * m]
    if groups.shard_shm is not None and not torch.equal(out, order):
        bad.append("not the rank-order sum")
    if (integral or len(members) == 2) and not torch.equal(out, gloo):  # a + b == b + a
        bad.append("differs from gloo")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    if not torch.allclose(out.double(), gloo.double(), rtol=tol, atol=tol * 4):
        bad.append("far from gloo")
    return bad


def _check_all_gather(groups: Any, rank: int, tag: str) -> list[str]:
    from longboat.comm.handles import wait_for

    bad = []
    for dtype in DTYPES:
        for n in SIZES:
            mine = _inputs(math.ceil(n / groups.degree), dtype, rank, False)
            full = torch.full((mine.numel() * groups.degree,), 7, dtype=dtype)
            wait_for(groups.all_gather(full, mine))
            gloo = torch.empty_like(full)
            dist.all_gather_into_tensor(gloo, mine, group=groups.shard)
            if not torch.equal(full, gloo):
                bad.append(f"all-gather {tag} degree {groups.degree} {dtype} n={n}")
            inplace = gloo.clone()  # this rank's own slice of the output as the input
            part = inplace.view(groups.degree, -1)[groups.index]
            wait_for(groups.all_gather(inplace, part))
            if not torch.equal(inplace, gloo):
                bad.append(f"all-gather in place {tag} degree {groups.degree} {dtype} n={n}")
    return bad


def _bucket_in_params(n: int, dtype: torch.dtype, groups: Any) -> tuple[torch.Tensor, list]:
    """A bucket of ``n`` elements (the same on every rank) and this rank's parameters cut at
    the same random points: its own slice holds the bucket's values, the rest 7."""
    true = _inputs(n, dtype, 99, False)
    cuts = torch.randperm(n, generator=torch.Generator().manual_seed(n))[: min(n - 1, 9)] + 1
    bounds = [0, *sorted(int(c) for c in cuts if c < n), n]
    m = math.ceil(n / groups.degree)
    lo, hi = groups.index * m, min((groups.index + 1) * m, n)
    params = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        t = torch.full((b - a,), 7, dtype=dtype)
        s, e = max(a, lo), min(b, hi)
        if s < e:
            t[s - a : e - a] = true[s:e]
        params.append((a, t))
    return true, params


def _placed(params: list, r: int, m: int, n: int) -> list:
    """Rank ``r``'s slice as pieces of ``params``: ``(column in the slice, view)``."""
    lo, hi, out = r * m, min((r + 1) * m, n), []
    for at, t in params:
        a, b = max(lo, at), min(hi, at + t.numel())
        if a < b:
            out.append((a - lo, t[a - at : b - at]))
    return out


def _check_placed(groups: Any, rank: int, tag: str) -> list[str]:
    """Slices cut over many parameters gathered straight into them; a closed gate writes
    nothing."""
    import contextlib

    from longboat.comm.handles import wait_for
    from longboat.comm.placed import PlacedSlices

    bad = []
    for dtype in DTYPES:
        for n in SIZES:
            for wanted in (True, False):
                true, params = _bucket_in_params(n, dtype, groups)
                m, me = math.ceil(n / groups.degree), groups.index
                rows = [[] if r == me else _placed(params, r, m, n) for r in range(groups.degree)]
                slices = PlacedSlices(
                    m, _placed(params, me, m, n), rows, lambda w=wanted: contextlib.nullcontext(w)
                )
                handle = groups.all_gather_placed(slices)
                if handle is None:
                    return [f"placed all-gather {tag}: not through shared memory"]
                wait_for(handle)
                got = torch.cat([t for _, t in params])
                expected = true if wanted else _bucket_in_params(n, dtype, groups)[1]
                if not wanted:
                    expected = torch.cat([t for _, t in expected])
                if not torch.equal(got, expected):
                    bad.append(f"placed all-gather {tag} {dtype} n={n} gate open={wanted}")
    return bad


def _check_replicas(groups: Any, rank: int) -> list[str]:
    from longboat.comm.handles import wait_for

    bad = []
    for dtype in DTYPES:
        for n in SIZES:
            ours = _inputs(n, dtype, rank, False)
            gloo = ours.clone()
            wait_for(groups.sum_over_replicas(ours))
            dist.all_reduce(gloo, group=groups.replicas)
            if not torch.equal(ours, gloo):  # two replicas: the same sum, bit for bit
                bad.append(f"sum over replicas {dtype} n={n}")
    return bad


def _check_handles(groups: Any, rank: int) -> list[str]:
    """Several in flight, waited out of order; the future holds the output and chains."""
    from longboat.comm.handles import FutureHandle, future_of, wait_for

    d, bad = groups.degree, []
    fulls = [torch.full((d * n,), float(rank + 1)) for n in (3, 300_000, 1, 70_000)]
    outs = [torch.empty(f.numel() // d) for f in fulls]
    handles = [groups.reduce_scatter(o, f) for o, f in zip(outs, fulls, strict=True)]
    if not all(isinstance(h, FutureHandle) for h in handles):
        bad.append(f"not through shared memory: {[type(h).__name__ for h in handles]}")
    doubled = future_of(handles[1]).then(lambda fut: fut.value() * 2)
    for h in reversed(handles):
        wait_for(h)
    members = dist.get_process_group_ranks(groups.shard)
    total = float(sum(r + 1 for r in members))
    if not all(bool((o == total).all()) for o in outs):
        bad.append("several in flight")
    if future_of(handles[0]).wait() is not outs[0] or not torch.equal(doubled.wait(), outs[1] * 2):
        bad.append("the future does not hold the output")
    try:
        groups.reduce_scatter(torch.empty(2), torch.empty(d * 3))
        bad.append("mismatched sizes accepted")
    except ValueError as exc:
        if "slices" not in str(exc):
            bad.append(f"mismatched sizes: {exc}")
    return bad


def _spread_over_nodes(rank: int) -> dict[str, Any]:
    """Nodes {0, 1} and {2, 3}: shard groups of 2 share a node, replicas and 4 do not."""
    import longboat.cluster as cluster
    from longboat.cluster.topology import Topology
    from longboat.sharding.zero.groups import ShardGroups

    real = cluster.topology
    cluster.topology = lambda: Topology((0, 0, 1, 1), rank)  # type: ignore[assignment]
    try:
        pairs, whole = ShardGroups.make(2), ShardGroups.make(WORLD)
    finally:
        cluster.topology = real  # type: ignore[assignment]
    return {
        "pairs": (pairs.shard_shm is not None, pairs.replicas_shm is not None),
        "whole": whole.shard_shm is not None,
        "bad": _check_reduce_scatter(whole, rank, "gloo") + _check_replicas(pairs, rank),
    }


def _shared_with_the_allreduce(rank: int) -> dict[str, Any]:
    """Groups over the allreduce's ranks run on its shm (no segments of their own), the
    others map their own; collectives queued between allreduces on the one worker, none
    waited for before the last, all come out right."""
    from longboat import cluster
    from longboat.comm.algorithms import make
    from longboat.comm.handles import wait_for
    from longboat.comm.shm_segment import mapped_segments
    from longboat.sharding.zero.groups import ShardGroups

    allreduce = make("shm", cluster.new_group())
    before = set(mapped_segments())
    whole, single, pairs = (ShardGroups.make(d, [allreduce]) for d in (WORLD, 1, 2))
    new = {n.rsplit("-", 2)[0] for n in set(mapped_segments()) - before}
    total = float(sum(r + 1 for r in range(WORLD)))
    sums = [torch.full((n,), float(rank + 1)) for n in (70_001, 3, 5)]
    fulls = [torch.full((WORLD * n,), float(rank + 1)) for n in (300_000, 1)]
    outs = [torch.empty(f.numel() // WORLD) for f in fulls]
    gathered = torch.empty(WORLD * 4)
    handles = [
        allreduce(sums[0]),
        whole.reduce_scatter(outs[0], fulls[0]),
        allreduce(sums[1]),
        whole.all_gather(gathered, torch.full((4,), float(rank))),
        single.sum_over_replicas(sums[2]),
        whole.reduce_scatter(outs[1], fulls[1]),
    ]
    for h in handles:
        wait_for(h)
    right = all(bool((t == total).all()) for t in [*sums, *outs])
    right = right and torch.equal(gathered, torch.arange(WORLD).repeat_interleave(4).float())
    return {
        "shared": (whole.shard_shm is allreduce, single.replicas_shm is allreduce),
        "own": pairs.shard_shm is not allreduce and pairs.replicas_shm is not allreduce,
        "new groups": sorted(new),
        "pairs": sorted({pairs.shard_shm.comm.prefix, pairs.replicas_shm.comm.prefix}),
        "right": right,
        "prefix": allreduce.comm.prefix,
    }


def _all(rank: int, world: int) -> dict[str, Any]:
    import longboat as lb
    from longboat.comm.algorithms.shm import ShmAllreduce, ShmComm
    from longboat.sharding.zero.groups import ShardGroups

    lb.init(backend="gloo")
    out: dict[str, Any] = {"bad": [], "shm": {}}
    for degree in (WORLD, 2):
        groups = ShardGroups.make(degree)
        out["shm"][degree] = (groups.shard_shm is not None, groups.replicas_shm is not None)
        pieces = dataclasses.replace(
            groups, shard_shm=ShmAllreduce(ShmComm(groups.shard, piece_bytes=PIECE))
        )
        for g, tag in ((groups, "whole"), (pieces, "pieces")):
            out["bad"] += _check_reduce_scatter(g, rank, tag)
            out["bad"] += _check_all_gather(g, rank, tag)
            out["bad"] += _check_placed(g, rank, tag)
        out["bad"] += _check_handles(groups, rank)
        if groups.replicas is not None:
            out["bad"] += _check_replicas(groups, rank)
    out["nodes"] = _spread_over_nodes(rank)
    out["shared"] = _shared_with_the_allreduce(rank)
    prefixes = (groups.shard_shm.comm.prefix, out["shared"]["prefix"])
    out["after shutdown"] = _left_after_shutdown(prefixes)
    return out


def _left_after_shutdown(prefixes: tuple[str, ...]) -> dict[str, int]:
    """The shm workers and this rank's segments of groups ``prefixes`` that outlive
    ``lb.shutdown()``."""
    import threading

    import longboat as lb
    from longboat.comm.shm_segment import shm_dir

    mine = [p for p in shm_dir().iterdir() if p.name.startswith(prefixes)]
    lb.shutdown()
    return {
        "segments before": len(mine),
        "segments": sum(p.exists() for p in mine),
        "workers": sum(t.name == "longboat-shm" and t.is_alive() for t in threading.enumerate()),
    }


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_ranks(_all, WORLD, timeout=300)


def test_collectives_equal_gloos(runs):
    for rank, result in enumerate(runs):
        assert result["bad"] == [], f"rank {rank}: {result['bad']}"


def test_shared_memory_is_used_on_one_node(runs):
    assert all(r["shm"] == {WORLD: (True, False), 2: (True, True)} for r in runs)


def test_shutdown_stops_the_shm_workers_and_removes_the_segments(runs):
    """An elastic world change (``lb.shutdown``, ``lb.init``) leaves no worker or segment of
    the old world behind."""
    for result in runs:
        assert result["after shutdown"]["segments before"] > 0
        assert result["after shutdown"] == {**result["after shutdown"], "segments": 0, "workers": 0}


def test_groups_over_the_allreduces_ranks_share_its_shared_memory(runs):
    """Sharding's groups over the allreduce's ranks map no segments of their own (pairs of
    ranks do: the allreduce spans all four), and its collectives queued on the allreduce's
    worker between allreduces all come out right."""
    for rank, result in enumerate(runs):
        shared = result["shared"]
        assert shared["shared"] == (True, True) and shared["own"], rank
        assert shared["new groups"] == shared["pairs"], rank
        assert shared["right"], rank


def test_groups_spread_over_nodes_stay_on_gloo(runs):
    for rank, result in enumerate(runs):
        assert result["nodes"]["pairs"] == (True, False) and not result["nodes"]["whole"]
        assert result["nodes"]["bad"] == [], f"rank {rank}: {result['nodes']['bad']}"


def test_tensors_shm_cannot_take_go_to_the_backend():
    from longboat.sharding.zero.groups import _fits

    assert _fits(torch.zeros(4), torch.zeros(8, dtype=torch.float32))
    assert not _fits(torch.zeros(4, 2).t())  # not contiguous
    assert not _fits(torch.zeros(4, dtype=torch.bool))
    assert not _fits(torch.zeros(4, dtype=torch.complex64))
    assert not _fits(torch.empty(4, device="meta"))  # stands for a GPU tensor: NCCL keeps it
