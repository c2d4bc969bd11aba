"""A 2-rank run with the timeline on writes one valid Chrome trace with every lane per rank."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from longboat.trace import rank_stats
from longboat.trace.recorder import rank_path
from tests._dist import run_ranks

STEPS = 4


def _train(rank: int, world_size: int, path: str) -> int:
    import longboat as lb

    strategy = lb.Strategy(timeline=path, nccl_comm_num=2, fuse_grad_size_in_MB=0.001)
    lb.init(strategy)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )
    model, opt = lb.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    batches = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(STEPS)]
    for x, y in lb.trace.data(batches):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model.reducer.num_buckets


def test_two_rank_timeline_has_every_lane_per_rank(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    buckets = run_ranks(_train, 2, str(path), timeout=120)[0]
    assert buckets >= 2  # two communicators both get work
    for rank in (0, 1):  # each rank's file: a closed JSON array, one event per line
        lines = rank_path(path, rank).read_text().splitlines()
        assert lines[0] == "[" and lines[-1] == "]"
        assert len(json.loads("\n".join(lines))) == len(lines) - 2
    doc = json.loads(path.read_text())  # valid JSON, Chrome trace object form
    events = doc["traceEvents"]
    names = {
        (e["pid"], e["args"]["name"])
        for e in events
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    assert names == {(0, "rank 0"), (1, "rank 1")}
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    for pid in (0, 1):
        spans = [e for e in events if e["ph"] == "X" and e["pid"] == pid]
        used = {lanes[(pid, e["tid"])] for e in spans}
        assert used == {"compute", "comm0", "comm1", "optimizer", "data"}, used
        by_name = [e["name"] for e in spans]
        assert by_name.count("forward") == STEPS and by_name.count("backward") == STEPS
        assert by_name.count("optimizer step") == STEPS and by_name.count("next batch") == STEPS
        comm = [e for e in spans if lanes[(pid, e["tid"])].startswith("comm")]
        assert len(comm) == STEPS * buckets
        # the default algorithm on one CPU node: shared memory
        assert all(e["args"]["bytes"] > 0 and e["args"]["algorithm"] == "shm" for e in comm)
        ready = [e for e in events if e["ph"] == "i" and e["pid"] == pid]
        assert len(ready) == STEPS * buckets
        for e in spans:
            assert e["dur"] >= 0 and e["ts"] >= 0
    stats = rank_stats(events)
    assert [s.rank for s in stats] == [0, 1]
    assert all(s.steps == STEPS and s.comm_ms > 0 and s.compute_ms > 0 for s in stats)
