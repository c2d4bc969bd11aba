"""Elastic jobs end to end: launchers on this machine as nodes; a node is lost or added
mid-epoch and training goes on from memory. The final parameters must equal a single-process
replay of exactly the committed global batches; every sample is used once."""

from __future__ import annotations

import json

import pytest
import torch

from tests.elastic._cluster import local_cluster
from tests.elastic._replay import replay

pytestmark = pytest.mark.slow  # slow tier: elastic launchers that lose, gain and hang nodes

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
    join_at_commit_3_and_check_against_the_replay(tmp_path)


def join_at_commit_3_and_check_against_the_replay(tmp_path, **env: object) -> None:
    """Two nodes train; a third starts after commit 3 and joins at commit 5; the run ends on
    3 ranks and equals a single-process replay of the committed batches. ``env``: more
    probe settings."""
    out_file = tmp_path / "out.json"
    with local_cluster(
        tmp_path,
        "2:3",
        PROBE_OUT=out_file,
        PROBE_WAIT_FOR_WORLD="3@5",
        PROBE_SAMPLES=SAMPLES,
        **env,
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


def _records(directory) -> list[dict]:
    """Every line the probe ranks wrote to PROBE_DIGESTS, in file order per rank."""
    lines = []
    for path in sorted(directory.glob("digests-*.jsonl")):
        lines += [json.loads(line) for line in path.read_text().splitlines() if line]
    return lines


def test_a_node_joins_a_world_of_one_leaves_and_joins_again_and_every_round_agrees(tmp_path):
    """Node 0 alone (world 1), node 1 joins at commit 2, leaves at 5, node 2 joins at 8: at
    every membership change all ranks hold the same parameters and optimizer state (the
    probe's own sha256), the same commit count and sampler progress; at the end node 2's
    parameters equal node 0's bit for bit."""
    out_file, digests = tmp_path / "out.json", tmp_path / "digests"
    digests.mkdir()
    with local_cluster(
        tmp_path,
        "1:2",
        PROBE_OUT=out_file,
        PROBE_DIGESTS=digests,
        PROBE_WAIT_FOR_WORLD="2@2,1@5,2@8",
        PROBE_SAMPLES=SAMPLES,
    ) as cluster:
        cluster.start()
        cluster.wait_for_commits(2)
        cluster.start()
        cluster.wait_for_commits(5)
        left = cluster.leave(1)
        cluster.wait_for_commits(8)
        cluster.start()
        ends = cluster.wait(timeout=150)
    assert left == 143, ends[1]
    assert [ends[0][0], ends[2][0]] == [0, 0], ends
    console = ends[0][1]
    for change in ("world size 1 -> 2", "world size 2 -> 1"):
        assert change in console, console[-3000:]
    assert console.count("world size 1 -> 2") == 2, console[-3000:]

    records = _records(digests)
    starts = [r for r in records if not r.get("final")]
    by_round: dict[str, list[dict]] = {}
    for r in starts:
        by_round.setdefault(r["token"], []).append(r)
    rounds = sorted(by_round.values(), key=lambda rs: rs[0]["commits"])
    # a join into a world of one: the joiner starts where node 0 is, not from scratch
    assert [(rs[0]["commits"], rs[0]["world"], len(rs)) for rs in rounds] == [
        (0, 1, 1),
        (2, 2, 2),
        (5, 1, 1),
        (8, 2, 2),
    ], [(r["node"], r["token"], r["commits"], r["world"]) for r in starts]
    for rs in rounds:
        assert sorted(r["rank"] for r in rs) == list(range(rs[0]["world"]))
        for r in rs[1:]:
            for key in ("digest", "commits", "processed", "steps"):
                assert r[key] == rs[0][key], (key, rs)
    assert {r["node"] for r in rounds[1]} == {"0", "1"}
    assert {r["node"] for r in rounds[3]} == {"0", "2"}

    finals = {r["node"]: r for r in records if r.get("final")}
    assert set(finals) == {"0", "2"}, finals.keys()
    assert finals["2"]["params"] == finals["0"]["params"]
    assert finals["2"]["digest"] == finals["0"]["digest"]
    assert finals["2"]["commits"] == finals["0"]["commits"]

    logs = "".join(p.read_text() for p in tmp_path.glob("node0/workerlog.*"))
    assert logs.count("state digests agree on all 2 ranks") == 2, logs[-3000:]
    out = json.loads(out_file.read_text())
    worlds = [w for w, _ in out["history"]]
    assert worlds[:2] == [1, 1] and worlds[2:5] == [2, 2, 2] and worlds[5:8] == [1, 1, 1]
    assert set(worlds[8:]) == {2}, worlds
    _check_against_replay(out)


def test_a_launcher_whose_peers_went_on_without_it_ends_promptly(tmp_path):
    """Node 1's rank ends at commit 3 as if done; node 0's rank loses it and finishes alone in
    a new round. Node 1's launcher, at the exit barrier of the old round, does not wait for a
    node that will not come: both launchers end on their own, and the rendezvous stays open
    for node 0 until it finishes."""
    out_file = tmp_path / "out.json"
    with local_cluster(
        tmp_path,
        "1:2",
        PROBE_OUT=out_file,
        PROBE_WAIT_FOR_WORLD="2@1",
        PROBE_SAMPLES=SAMPLES,
    ) as cluster:
        cluster.start()
        cluster.wait_for_commits(1)
        cluster.start(PROBE_QUIT_AT=3)
        ends = cluster.wait(timeout=120)
    assert [code for code, _ in ends] == [0, 0], ends
    early = ends[1][1]
    assert "did not finish with them" in early and "not waiting for them" in early, early[-2000:]
    assert "world size 2 -> 1" in ends[0][1], ends[0][1][-2000:]
    out = json.loads(out_file.read_text())
    worlds = [w for w, _ in out["history"]]
    assert worlds[:3] == [1, 2, 2] and set(worlds[3:]) == {1}, worlds
    _check_against_replay(out)
