"""Elastic jobs whose optimizer state is sharded (``Strategy(sharding=True)``), end to end with
launchers on this machine as nodes: a node that joins gets its slices (at stage 3 its shards
of the parameters too) resharded from the others' memory, and the run equals a
single-process replay of the committed global batches; a node lost with the only copy of its
shard stops the job, naming the shard and the way back (the last sharded checkpoint), or goes
on from State's sharded checkpoint when it writes them."""

from __future__ import annotations

import json
import re

import pytest

from tests.elastic._cluster import local_cluster
from tests.elastic.test_elastic_crash import _assert_resumed_at, crash
from tests.elastic.test_elastic_launch import (
    SAMPLES,
    _check_against_replay,
    join_at_commit_3_and_check_against_the_replay,
)

pytestmark = pytest.mark.slow  # slow tier: elastic launchers that gain and lose nodes


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_node_joining_a_sharded_job_gets_its_slices_and_training_equals_the_replay(
    tmp_path, stage
):
    join_at_commit_3_and_check_against_the_replay(tmp_path, PROBE_SHARDING=stage)


def test_a_node_lost_with_the_only_copy_of_its_shard_stops_the_job_naming_it(tmp_path):
    with local_cluster(
        tmp_path,
        "2:3",
        PROBE_SLEEP=0.05,
        PROBE_DIE="2@4",
        PROBE_SAMPLES=SAMPLES,
        PROBE_SHARDING=1,
    ) as cluster:
        for _ in range(3):
            cluster.start()
        ends = cluster.wait()
    survivors = [text for code, text in ends if code not in (-9, 137)]
    assert len(survivors) == 2, ends
    for code, text in ends:
        if text in survivors:
            assert code != 0, text[-2000:]
    logs = "".join(p.read_text() for p in tmp_path.glob("node*/workerlog.*"))
    assert "ShardsLostError" in logs, logs[-3000:]
    assert "shard 2 of 3" in logs and "load_sharded_checkpoint" in logs, logs[-3000:]



def test_a_node_lost_at_stage_3_leaves_a_whole_copy_on_every_node_and_training_goes_on(tmp_path):
    """Across nodes stage 3 shards within each node (here one rank: HSDP of whole copies), so
    node 2 dying after commit 4 loses nothing: the other two go on from memory and the run
    equals the replay."""
    out_file = tmp_path / "out.json"
    with local_cluster(
        tmp_path,
        "2:3",
        PROBE_OUT=out_file,
        PROBE_SLEEP=0.05,
        PROBE_DIE="2@4",
        PROBE_SAMPLES=SAMPLES,
        PROBE_SHARDING=3,
    ) as cluster:
        for _ in range(3):
            cluster.start()
        ends = cluster.wait(timeout=180)
    assert sorted(code for code, _ in ends)[1:] == [0, 0], ends
    logs = "".join(p.read_text() for p in tmp_path.glob("node*/workerlog.*"))
    assert "3 replicas (HSDP)" in logs and "2 ranks on 2 nodes" in logs, logs[-3000:]
    out = json.loads(out_file.read_text())
    worlds = [w for w, _ in out["history"]]
    assert worlds[:4] == [3, 3, 3, 3] and set(worlds[4:]) == {2}, worlds
    _check_against_replay(out)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_rank_restarted_without_its_shards_goes_on_from_the_sharded_checkpoint(
    tmp_path, stage
):
    """Two nodes split the optimizer state (at stage 3 every parameter too; sharding_degree
    2); node 1's rank dies just after commit 5 and restarts with no copy (node copies off):
    its shards are gone, so both ranks take the State's last complete checkpoint (written
    every 2 commits: commit 4, or 6 when the death landed after that save) and train on; the
    run equals the replay. The same rule at every stage."""
    ends, _ = crash(
        tmp_path,
        2,
        "1@5+0.02",
        PROBE_NODE_COPY=0,
        PROBE_SHARDING=stage,
        PROBE_DEGREE=2,
        PROBE_CHECKPOINT=tmp_path / "ckpt",
    )
    assert [code for code, _ in ends] == [0, 0], ends
    logs = "".join(p.read_text() for p in tmp_path.glob("node*/workerlog.*"))
    assert re.search(r"took the sharded checkpoint in \S+: commit [46], ", logs), logs[-3000:]
    _check_against_replay(json.loads((tmp_path / "out.json").read_text()))


def test_every_rank_killed_at_stage_3_resumes_every_shard_from_the_node_copies(tmp_path):
    """Each rank's node copy holds its own shards of the parameters and optimizer state."""
    ends, records = crash(tmp_path, 2, "all@5+0.02", PROBE_SHARDING=3, PROBE_DEGREE=2)
    _assert_resumed_at(tmp_path, ends, records, 2, 5)
