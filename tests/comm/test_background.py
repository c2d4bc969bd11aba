"""BackgroundAllreduce: ordered worker-thread collectives, stopped at interpreter exit."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from longboat.comm import background
from longboat.comm.background import BackgroundAllreduce


def _double(t: torch.Tensor) -> None:
    torch.add(t, t, out=t)


def test_work_runs_in_submission_order_and_futures_carry_the_tensor() -> None:
    seen: list[int] = []
    worker = BackgroundAllreduce(lambda t: seen.append(int(t[0])), "order")
    futures = [worker(torch.tensor([float(i)])) for i in range(20)]
    assert [int(f.wait()[0]) for f in futures] == list(range(20))
    assert seen == list(range(20))
    worker.close()


def test_workers_left_open_are_stopped_at_exit() -> None:
    """A worker thread alive while the interpreter tears torch down aborts the process
    ("terminate called without an active exception", seen with a DDP hook over shm): the
    exit hook stops every worker nobody closed."""
    worker = BackgroundAllreduce(_double, "forgotten")
    assert torch.equal(worker(torch.ones(3)).wait(), torch.full((3,), 2.0))
    assert worker in background._LIVE
    background._stop_all()  # what atexit runs
    assert not worker._thread.is_alive()
    assert worker not in background._LIVE
    worker.close()  # closing again is harmless


def test_a_process_that_never_closes_its_worker_exits_cleanly() -> None:
    script = textwrap.dedent(
        """
        import torch
        from longboat.comm.background import BackgroundAllreduce
        w = BackgroundAllreduce(lambda t: torch.add(t, t, out=t), "probe")
        for _ in range(5):
            w(torch.ones(1024)).wait()
        print("done")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "done" and "Exception" not in done.stderr
