"""Faults that kill every process holding the state in memory, while the nodes (launchers)
live: the ranks restarted there resume from their node's copy of the last commit, losing
nothing; with the copies off, the job ends in one line instead of training from scratch."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.elastic._cluster import local_cluster
from tests.elastic.test_elastic_launch import SAMPLES, _check_against_replay, _records

pytestmark = pytest.mark.slow  # slow tier: launchers on this machine, ranks killed and restarted


def crash(
    tmp_path: Path,
    nodes: int,
    kill: str,
    min_nodes: int | None = None,
    samples: int = SAMPLES,
    **env: object,
) -> tuple[list, list[dict]]:
    """``nodes`` launchers (``--nnodes MIN:nodes``, 2 restarts each) train the probe on
    ``samples``; ``kill`` is its PROBE_KILL (the kill times go to ``tmp_path/pids``). Returns
    every launcher's (exit code, console) and the ranks' digest records."""
    digests = tmp_path / "digests"
    digests.mkdir()
    with local_cluster(
        tmp_path,
        f"{min_nodes or nodes}:{nodes}",
        ("--max-restarts", "2"),
        PROBE_OUT=tmp_path / "out.json",
        PROBE_SLEEP=0.05,
        PROBE_SAMPLES=samples,
        PROBE_DIGESTS=digests,
        PROBE_KILL=kill,
        **env,
    ) as cluster:
        for _ in range(nodes):
            cluster.start()
        ends = cluster.wait(timeout=240)
    return ends, _records(digests)


def starts_of(records: list[dict]) -> list[int]:
    """The commit each rank process started training from, one entry per process."""
    first: dict[int, int] = {}
    for line in records:
        if not line.get("final"):
            first.setdefault(line["pid"], line["commits"])
    return sorted(first.values())


def _assert_resumed_at(tmp_path: Path, ends: list, records: list[dict], nodes: int, at: int):
    assert [code for code, _ in ends] == [0] * nodes, ends
    starts = starts_of(records)
    assert starts.count(0) == nodes, f"a rank trained from scratch: {starts}"
    assert set(starts) <= {0, at}, f"committed steps lost: ranks started at {starts}"
    out = json.loads((tmp_path / "out.json").read_text())
    _check_against_replay(out)  # every sample once, parameters equal a one-process replay


def test_every_rank_killed_at_once_resumes_from_the_last_commit(tmp_path: Path) -> None:
    ends, records = crash(tmp_path, 2, "all@5+0.02")
    _assert_resumed_at(tmp_path, ends, records, 2, 5)
    logs = "".join(p.read_text() for p in tmp_path.glob("node*/workerlog.*"))
    assert "took this node's copy of commit 5" in logs


def test_two_ranks_killed_within_two_seconds_on_three_nodes_lose_no_commit(
    tmp_path: Path,
) -> None:
    delay = random.Random(7).uniform(0.6, 1.9)
    ends, records = crash(tmp_path, 3, f"1@5+0,2@5+{delay:.2f}")
    assert [code for code, _ in ends] == [0, 0, 0], ends
    starts = starts_of(records)
    assert starts.count(0) == 3, f"a rank trained from scratch: {starts}"
    _check_against_replay(json.loads((tmp_path / "out.json").read_text()))


def test_every_rank_killed_without_node_copies_ends_in_one_line_and_never_starts_over(
    tmp_path: Path,
) -> None:
    ends, records = crash(tmp_path, 2, "all@5+0.02", PROBE_NODE_COPY=0)
    assert all(code != 0 for code, _ in ends), ends
    for _, console in ends:
        assert "the job stops: every copy of the committed state is lost: the job had " in console
        assert "reached commit 5" in console, console[-2000:]
    assert starts_of(records) == [0, 0], "only the first ranks trained"
    assert not (tmp_path / "out.json").exists()


def test_every_rank_killed_with_a_sharded_optimizer_resumes_every_shard(tmp_path: Path) -> None:
    """Each rank's node copy holds its own slices: no shard is lost with the ranks."""
    ends, records = crash(tmp_path, 2, "all@5+0.02", PROBE_SHARDING=2)
    _assert_resumed_at(tmp_path, ends, records, 2, 5)
