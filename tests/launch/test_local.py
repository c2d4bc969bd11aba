"""launch_local: real ranks through torch's elastic agent, results and failures coming back."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from longboat.launch.local import LaunchError, launch_local

pytestmark = pytest.mark.timeout(120)


def allreduce_rank() -> dict[str, object]:
    """Sum the ranks over gloo; report what the launcher put in the environment."""
    dist.init_process_group("gloo")
    try:
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return {
            "sum": t.item(),
            "rank": int(os.environ["RANK"]),
            "world_size": dist.get_world_size(),
            "omp": os.environ.get("OMP_NUM_THREADS"),
            "extra": os.environ.get("LB_TEST_EXTRA"),
        }
    finally:
        dist.destroy_process_group()


def rank1_raises() -> None:
    """Rank 1 raises; rank 0 blocks in an allreduce that can never complete."""
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ValueError("rank one exploded on purpose")
    dist.all_reduce(torch.zeros(1))


def rank1_sigkills() -> None:
    """Rank 1 kills itself; rank 0 blocks in an allreduce that can never complete."""
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.zeros(1))


def sleep_forever() -> None:
    time.sleep(3600)


def test_two_ranks_allreduce_and_return_values() -> None:
    out = launch_local(allreduce_rank, nproc=2, env={"LB_TEST_EXTRA": "yes"}, timeout=60)
    assert sorted(out) == [0, 1]
    for rank, result in out.items():
        assert result["sum"] == 1.0
        assert result["rank"] == rank
        assert result["world_size"] == 2
        assert result["extra"] == "yes"
        expected_omp = os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // 2)))
        assert result["omp"] == expected_omp
    assert "LB_TEST_EXTRA" not in os.environ


def test_failing_rank_is_named_with_its_error() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(LaunchError) as info:
        launch_local(rank1_raises, nproc=2, timeout=60)
    message = str(info.value)
    assert message.startswith("launch_local: rank 1 failed")
    assert "ValueError: rank one exploded on purpose" in message
    assert next(iter(info.value.failures)) == 1
    assert signal.getsignal(signal.SIGTERM) == before


def test_killed_rank_is_named_and_the_stopped_rank_listed() -> None:
    with pytest.raises(LaunchError) as info:
        launch_local(rank1_sigkills, nproc=2, timeout=60)
    message = str(info.value)
    assert message.startswith("launch_local: rank 1 failed (killed by SIGKILL)"), message
    assert list(info.value.failures) == [1]
    assert info.value.stopped == [0]
    assert "stopped by the launcher as a consequence: rank 0" in message


def test_script_failure_shows_stderr_tail_from_log_dir(tmp_path: Path) -> None:
    code = "import os, sys; sys.exit('script rank ' + os.environ['RANK'] + ' gave up')"
    with pytest.raises(LaunchError) as info:
        launch_local(sys.executable, ["-c", code], nproc=2, log_dir=str(tmp_path), timeout=60)
    rank, failure = next(iter(info.value.failures.items()))  # the first rank to fail
    assert failure.exitcode == 1
    assert f"script rank {rank} gave up" in failure.error
    assert f"script rank {rank} gave up" in str(info.value)
    assert list(tmp_path.glob(f"*/attempt_0/{rank}/stderr.log"))


def test_script_failure_without_logs_says_how_to_get_them() -> None:
    with pytest.raises(LaunchError, match="pass log_dir"):
        launch_local(sys.executable, ["-c", "raise SystemExit(3)"], nproc=1, timeout=60)


def test_hanging_job_is_stopped_at_the_timeout() -> None:
    with pytest.raises(LaunchError, match="did not finish within 2 s"):
        launch_local(sleep_forever, nproc=2, timeout=2)


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="nproc"):
        launch_local(sleep_forever, nproc=0)
    with pytest.raises(ValueError, match="timeout"):
        launch_local(sleep_forever, timeout=0)


def test_port_taken_meanwhile_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    import longboat.launch.local as local

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        ports = iter([squatter.getsockname()[1]])
        fresh = local._free_port
        monkeypatch.setattr(local, "_free_port", lambda: next(ports, None) or fresh())
        out = launch_local(allreduce_rank, nproc=2, timeout=60)
    assert [r["sum"] for r in out.values()] == [1.0, 1.0]
