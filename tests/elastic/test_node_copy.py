"""The node's copy of a rank's last commit, and where a round resumes: a rank started on a
node that kept a copy holds that state again; a round never resumes below the job's highest
commit without a word, and never from nothing (in one process, no launcher)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import longboat as lb
from longboat.elastic import node_copy
from longboat.elastic.membership import clear_round_files, stop_reason, write_commits, write_stop
from longboat.elastic.recovery import StateLostError
from longboat.elastic.state import State
from longboat.launch.elastic_files import remove_orphans


@pytest.fixture
def elastic_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """An elastic directory and a copy directory, as the launcher gives its ranks."""
    elastic, copies = tmp_path / ".elastic", tmp_path / "copies"
    elastic.mkdir()
    monkeypatch.setenv("LONGBOAT_ELASTIC_DIR", str(elastic))
    monkeypatch.setenv("LONGBOAT_ELASTIC_COPY_DIR", str(copies))
    return elastic, copies


def _job(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    sampler = lb.elastic.ElasticSampler(64, 4, shuffle=True, seed=3)
    return net, optimizer, sampler


def _train(state: State, steps: int) -> None:
    state.sampler.set_epoch(0)
    for i in range(steps):
        x = torch.full((4, 4), float(i + 1)) / 7
        loss = state.model(x).square().mean()
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()
        state.sampler.record_batch()
        state.history.append(i)
        state.commit()


def _trained(steps: int, **options: Any) -> State:
    net, optimizer, sampler = _job(seed=0)
    state = State(model=net, optimizer=optimizer, sampler=sampler, history=[], **options)
    state.sync()
    _train(state, steps)
    assert state.flush_node_copy(timeout=30)
    return state


def _restarted(**options: Any) -> State:
    """What a rank restarted on the node builds: the script's fresh objects."""
    net, optimizer, sampler = _job(seed=1)
    return State(model=net, optimizer=optimizer, sampler=sampler, history=[], **options)


def test_a_rank_started_on_the_node_takes_the_copy_of_the_last_commit_bit_for_bit(
    elastic_dirs: tuple[Path, Path],
) -> None:
    old = _trained(5)
    _, copies = elastic_dirs
    assert node_copy.newest(copies, 0)[0] == 5  # on the node as soon as commit() returned
    new = _restarted()
    assert not new.holds_state
    new.sync()
    assert new.holds_state and new.commits == 5 and new.history == [0, 1, 2, 3, 4]
    assert new.digest() == old.digest()
    for a, b in zip(new.model.state_dict().values(), old.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert new.sampler.processed_indices() == old.sampler.processed_indices()


def test_without_any_copy_a_job_that_had_committed_stops_in_one_line_naming_the_commit(
    elastic_dirs: tuple[Path, Path],
) -> None:
    _trained(4, node_copy=False)
    _, copies = elastic_dirs
    assert not copies.exists()
    new = _restarted(node_copy=False)
    with pytest.raises(StateLostError) as caught:
        new.sync()
    message = str(caught.value)
    assert "\n" not in message
    assert "reached commit 4" in message and "node_copy=False" in message
    assert "checkpoint=PATH" in message
    assert new.commits == 0 and not new.holds_state


def test_a_removed_copy_also_stops_the_job(elastic_dirs: tuple[Path, Path]) -> None:
    _trained(3)
    _, copies = elastic_dirs
    for path in copies.iterdir():
        path.unlink()
    with pytest.raises(StateLostError, match=f"none in {copies}"):
        _restarted().sync()


def test_a_copy_behind_the_highest_commit_resumes_and_says_how_many_steps_are_redone(
    elastic_dirs: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    elastic, _ = elastic_dirs
    _trained(3)
    write_commits(elastic, 1, 5)  # another rank of the node reached commit 5
    new = _restarted()
    with caplog.at_level(logging.WARNING, logger="longboat.elastic"):
        new.sync()
    assert new.commits == 3
    assert "the job had reached commit 5, so 2 committed steps are trained again" in caplog.text


def test_a_checkpoint_is_a_copy_too(elastic_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt.pt"
    _trained(4, node_copy=False, checkpoint=ckpt, checkpoint_every=2)
    new = _restarted(node_copy=False, checkpoint=ckpt)
    assert new.load_checkpoint()
    new.sync()
    assert new.commits == 4


def test_a_fresh_job_starts_from_its_initial_state(elastic_dirs: tuple[Path, Path]) -> None:
    state = _restarted()
    assert state.sync() == 0 and state.commits == 0 and state.holds_state


def _tree(n: int) -> dict[str, Any]:
    return {"w": torch.full((1000,), float(n)), "n": n, "parts": [torch.arange(n), "x"]}


def _assert_tree(saved: dict[str, Any], n: int) -> None:
    assert saved["n"] == n and saved["parts"][1] == "x"
    assert torch.equal(saved["w"], torch.full((1000,), float(n)))
    assert torch.equal(saved["parts"][0], torch.arange(n))


def test_host_state_is_on_the_node_when_offer_returns(tmp_path: Path) -> None:
    writer = node_copy.NodeCopy(tmp_path, local_rank=2)
    for commits in range(1, 6):
        writer.offer(commits, _tree(commits))
        found, saved = node_copy.newest(tmp_path, 2)
        assert found == commits
        _assert_tree(saved, commits)
    assert node_copy.newest(tmp_path, 0) is None
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [f"state-2-{s}.{e}" for s in (0, 1) for e in ("bin", "meta")] + [
        "state-2.current"
    ]


def test_device_state_goes_through_the_writer_thread_and_the_newest_offer_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(node_copy, "_in_host_memory", lambda tree: False)
    writer = node_copy.NodeCopy(tmp_path, local_rank=0)
    for commits in range(1, 30):
        writer.offer(commits, _tree(commits))
    assert writer.flush(timeout=30)
    found, saved = node_copy.newest(tmp_path, 0)
    assert found == 29
    _assert_tree(saved, 29)


def test_a_rank_killed_while_it_writes_leaves_the_previous_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = node_copy.NodeCopy(tmp_path, local_rank=0)
    writer.offer(1, _tree(1))
    writer.offer(2, _tree(2))

    def killed(*args: Any, **kwargs: Any) -> None:
        raise SystemExit("killed while writing")

    monkeypatch.setattr(torch, "save", killed)  # the data is copied, the description never
    with pytest.raises(SystemExit):
        node_copy._Slots(tmp_path, 0).write(3, _tree(3))
    found, saved = node_copy.newest(tmp_path, 0)
    assert found == 2
    _assert_tree(saved, 2)


def test_a_copy_cut_short_is_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "state-0.current").write_text("1 7")
    (tmp_path / "state-0-1.meta").write_bytes(b"cut short")
    assert node_copy.newest(tmp_path, 0) is None
    assert "unreadable node copy" in caplog.text


def test_a_new_job_clears_what_an_earlier_one_left_in_the_elastic_directory(
    tmp_path: Path,
) -> None:
    for name in ("membership.json", "request-0", "ack-1", "commits-0", "stop-0", "keep.txt"):
        (tmp_path / name).write_text("x")
    clear_round_files(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


def test_a_stop_is_read_back_for_the_launcher(tmp_path: Path) -> None:
    assert stop_reason(tmp_path) == ""
    write_stop(tmp_path, 1, "every copy of the committed state is lost")
    assert stop_reason(tmp_path) == "every copy of the committed state is lost"


def test_copy_directories_of_launchers_that_are_gone_are_removed(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    uid = os.getuid()
    gone = tmp_path / f"longboat-copies-{uid}-{done.stdout.strip()}"
    mine = tmp_path / f"longboat-copies-{uid}-{os.getpid()}"
    other_user = tmp_path / f"longboat-copies-{uid + 1}-{done.stdout.strip()}"
    for path in (gone, mine, other_user):
        path.mkdir()
    assert remove_orphans(tmp_path) == 1
    assert not gone.exists() and mine.exists() and other_user.exists()
