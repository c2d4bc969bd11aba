"""init/topology/barrier/shutdown across real spawned ranks on Gloo."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import torch
import torch.distributed as dist

import longboat.cluster as lc
from tests._dist import run_ranks


def _check_ranks(rank: int, world_size: int, nodes: int) -> dict:
    """Emulate ``nodes`` nodes by node-rank variables, then report what longboat saw."""
    per_node = world_size // nodes
    if nodes > 1:
        os.environ.update(
            LONGBOAT_NODE_RANK=str(rank // per_node),
            LOCAL_RANK=str(rank % per_node),
            LOCAL_WORLD_SIZE=str(per_node),
        )
    before = (lc.rank(), lc.world_size(), lc.is_initialized())
    strategy = {"name": "test"}
    info = lc.init(strategy, timeout=60)
    again = lc.init()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    topo = lc.topology()
    lc.barrier(timeout=30)
    result = {
        "before": before,
        "info": (info.rank, info.world_size, info.local_rank, info.local_world_size),
        "node": (info.node_rank, info.num_nodes, lc.node_rank(), lc.num_nodes()),
        "source": (info.source, info.backend),
        "same": again is info and lc.current_strategy() is strategy,
        "sum": t.item(),
        "node_of": list(topo.node_of),
        "local_ranks": topo.local_ranks(),
        "leaders": topo.leaders(),
        "homogeneous": topo.is_homogeneous,
    }
    lc.shutdown()
    result["after"] = (lc.is_initialized(), dist.is_initialized())
    return result


def test_two_ranks_one_node() -> None:
    results = run_ranks(_check_ranks, 2, 1, timeout=90)
    for rank, res in enumerate(results):
        assert res["before"] == (rank, 2, False)
        assert res["info"] == (rank, 2, rank, 2)
        assert res["node"] == (0, 1, 0, 1)
        assert res["source"] == ("torch", "gloo")
        assert res["same"] is True
        assert res["sum"] == 3.0
        assert res["node_of"] == [0, 0]
        assert res["local_ranks"] == [0, 1]
        assert res["leaders"] == [0]
        assert res["after"] == (False, False)


def test_four_ranks_two_emulated_nodes() -> None:
    results = run_ranks(_check_ranks, 4, 2, timeout=120)
    for rank, res in enumerate(results):
        assert res["info"] == (rank, 4, rank % 2, 2)
        assert res["node"] == (rank // 2, 2, rank // 2, 2)
        assert res["sum"] == 10.0
        assert res["node_of"] == [0, 0, 1, 1]
        assert res["local_ranks"] == ([0, 1] if rank < 2 else [2, 3])
        assert res["leaders"] == [0, 2]
        assert res["homogeneous"] is True
        assert res["same"] is True


def _adopt_then_stall(rank: int, world_size: int, flags: str) -> dict:
    """Adopt a user-made group; then rank 1 skips a barrier so rank 0's must time out (rank 1
    waits until rank 0's barrier has ended, at most 30 s, before it goes on)."""
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    info = lc.init()
    error = ""
    ended = Path(flags, "barrier-ended")
    if rank == 0:
        try:
            lc.barrier(timeout=1)
        except lc.ClusterError as exc:
            error = str(exc)
        finally:
            ended.touch()
    else:
        deadline = time.monotonic() + 30
        while not ended.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    lc.shutdown()
    still = dist.is_initialized()
    return {"info": (info.rank, info.world_size, info.backend), "error": error, "still": still}


def test_adopted_group_and_barrier_timeout_names_missing_rank(tmp_path: Path) -> None:
    results = run_ranks(_adopt_then_stall, 2, str(tmp_path), timeout=60)
    assert [r["info"] for r in results] == [(0, 2, "gloo"), (1, 2, "gloo")]
    assert all(r["still"] for r in results), "shutdown must leave a user-made group alone"
    assert "within 1s" in results[0]["error"]
    assert re.search(r"Ranks? 1 failed", results[0]["error"]), results[0]["error"]
