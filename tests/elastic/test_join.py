"""A rank's place in its elastic round, as `longboat.elastic.join` hands it to the cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from longboat.cluster.info import ClusterInfo
from longboat.elastic import join, world
from longboat.elastic.membership import Membership, write_membership

FOUND = ClusterInfo(
    rank=0,
    world_size=1,
    local_rank=1,
    local_world_size=2,
    node_rank=0,
    num_nodes=1,
    master_addr="127.0.0.1",
    master_port=29500,
    source="torch",
)


def test_outside_an_elastic_job_the_place_is_the_environments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("LONGBOAT_ELASTIC_DIR", raising=False)
    assert join.place_in_round(FOUND) is FOUND


def test_a_rank_keeping_its_state_says_so_in_its_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lb.distribute skips the start-up broadcast when any rank of the round carries state
    (``State.sync`` brings it); a newcomer's place says it carries none."""
    round_ = Membership(
        token="r2",
        world_size=4,
        group_rank=1,
        group_world_size=2,
        ranks={0: 2, 1: 3},
        store="127.0.0.1:29500",
        nodes=["10.0.0.1[1]", "10.0.0.2[2]"],
    )
    write_membership(tmp_path, round_)
    monkeypatch.setenv("LONGBOAT_ELASTIC_DIR", str(tmp_path))
    for name in (*("RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE"),
                 *("LONGBOAT_NODE_RANK", "LONGBOAT_NNODES")):  # fmt: skip
        monkeypatch.setenv(name, "0")  # place_in_round sets them: restored after the test
    monkeypatch.setattr(world, "_survivor", False)
    newcomer = join.place_in_round(FOUND)
    assert (newcomer.rank, newcomer.world_size, newcomer.node_rank) == (3, 4, 1)
    assert newcomer.elastic_round == round_ and not newcomer.carries_state
    monkeypatch.setattr(world, "_survivor", True)  # moved to this round with its state
    assert join.place_in_round(FOUND).carries_state
