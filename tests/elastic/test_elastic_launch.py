"""Elastic jobs end to end: launchers on this machine as nodes; a node is lost or added
mid-epoch and training goes on from memory. The final parameters must equal a single-process
replay of exactly the committed global batches; every sample is used once."""

from __future__ import annotations

import json

import torch

from tests.elastic._cluster import local_cluster
from tests.elastic._replay import replay

SAMPLES = 96


def _check_against_replay(out: dict, samples: int = SAMPLES) -> None:
    history = out["history"]
    used = sorted(i for _, batches in history for batch in batches for i in batch)
    assert used == list(range(samples)), "every sample exactly once over the epoch"
    assert out["processed"] == list(range(samples))
    expected = replay(history, samples)
    for got, want in zip(out["params"], expected, strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5)


def test_a_lost_node_leaves_and_training_finishes_on_the_others(tmp_path):
    out_file = tmp_path / "out.json"
    with local_cluster(
        tmp_path,
        "2:3",
        PROBE_OUT=out_file,
        PROBE_SLEEP=0.05,
        PROBE_DIE="2@4",
        PROBE_SAMPLES=SAMPLES,
    ) as cluster:
        for _ in range(3):
            cluster.start()
        ends = cluster.wait()
    survivors = [e for e in ends if e[0] == 0]
    assert len(survivors) == 2, ends
    assert sum(1 for code, _ in ends if code == -9 or code == 137) <= 1
    console = survivors[0][1]
    assert "membership changed" in console and "left" in console, console
    assert "world size 3 -> 2" in console, console
    out = json.loads(out_file.read_text())
    worlds = [w for w, _ in out["history"]]
    assert worlds[:4] == [3, 3, 3, 3] and set(worlds[4:]) == {2}, worlds
    _check_against_replay(out)


def test_a_node_that_joins_gets_the_state_and_the_next_steps_use_it(tmp_path):
    out_file = tmp_path / "out.json"
    with local_cluster(
        tmp_path,
        "2:3",
        PROBE_OUT=out_file,
        PROBE_WAIT_FOR_WORLD="3@5",
        PROBE_SAMPLES=SAMPLES,
    ) as cluster:
        cluster.start()
        cluster.start()
        cluster.wait_for_commits(3)
        cluster.start()
        ends = cluster.wait()
    assert [code for code, _ in ends] == [0, 0, 0], ends
    assert "joined" in ends[0][1], ends[0][1][-1500:]
    out = json.loads(out_file.read_text())
    worlds = [w for w, _ in out["history"]]
    assert worlds[:5] == [2] * 5 and set(worlds[5:]) == {3}, worlds
    _check_against_replay(out)


def test_a_hung_rank_is_left_behind_and_killed(tmp_path):
    out_file = tmp_path / "out.json"
    with local_cluster(
        tmp_path,
        "2:3",
        PROBE_OUT=out_file,
        PROBE_SLEEP=0.05,
        PROBE_HANG="2@4",
        PROBE_SAMPLES=SAMPLES,
        LONGBOAT_TIMEOUT=4,
    ) as cluster:
        for _ in range(3):
            cluster.start()
        ends = cluster.wait(timeout=150)
    assert sorted(code for code, _ in ends) == [0, 0, 1], ends
    hung = next(text for code, text in ends if code == 1)
    assert "did not join round" in hung and "killed" in hung, hung[-2000:]
    out = json.loads(out_file.read_text())
    assert [w for w, _ in out["history"]][-1] == 2
    _check_against_replay(out)
