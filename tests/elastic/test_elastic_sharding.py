"""Elastic jobs whose optimizer state is sharded (``Strategy(sharding=True)``), end to end with
launchers on this machine as nodes: a node that joins gets its slices resharded from the
others' memory, and the run equals a single-process replay of the committed global batches;
a node lost with the only copy of its shard stops the job, naming the shard and the way back
(the last sharded checkpoint)."""

from __future__ import annotations

import pytest

from tests.elastic._cluster import local_cluster
from tests.elastic.test_elastic_launch import SAMPLES, join_at_commit_3_and_check_against_the_replay

pytestmark = pytest.mark.slow  # slow tier: elastic launchers that gain and lose nodes


@pytest.mark.parametrize("stage", [1, 2])
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
