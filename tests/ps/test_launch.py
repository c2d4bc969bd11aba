"""Real server processes: `longboat launch --servers 2 --workers 2` trains in sync mode, and a
launch whose trainers disagree with the server ends at once."""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from torch.distributed.elastic.multiprocessing.api import PContext

from longboat.ps.shared.auth import generate_token
from longboat.ps.shared.wire import Message
from longboat.ps.trainer.client import Client, PSError
from tests.collective import _workloads as W
from tests.ps._harness import server_processes

SCRIPT = Path(__file__).with_name("launch_train.py")


@pytest.mark.slow  # a whole end-to-end run: the slow tier (CI runs it after the quick one)
def test_launched_servers_and_trainers_match_global_batch(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "longboat", "launch", "--servers", "2", "--workers", "2",
         str(SCRIPT), str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    logs = "".join(p.read_text() for p in sorted(tmp_path.glob("log/*")) if p.is_file())
    assert done.returncode == 0, done.stdout + done.stderr + logs
    tokens = list(tmp_path.glob("log/.ps-token-*"))
    assert len(tokens) == 1 and tokens[0].stat().st_mode & 0o077 == 0  # per-job, owner-only
    cfg = W.Config()
    model = W.build_model(cfg, seed=0)
    want = W.train_global_batch(model, W.build_optimizer(cfg, model), cfg, 2)
    for rank in range(2):
        got = torch.load(tmp_path / f"trainer{rank}.pt", weights_only=True)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)


# ---- a refused trainer ends the whole job ------------------------------------------------------


def test_a_server_ends_on_sigterm_while_a_call_waits_for_a_trainer() -> None:
    """Trainer 0 of 2 waits at a barrier for trainer 1, which never comes: SIGTERM ends the
    wait (the caller gets UNAVAILABLE, not its deadline) and the server process, by SIGTERM."""
    token = generate_token()
    with server_processes(1, token) as [server], contextlib.closing(
        Client([server.endpoint], token, timeout=600)
    ) as client:  # fmt: skip
        client.call(0, "init", Message({"trainer": 0, "trainers": 2, "sync": True}))
        waiting = client.start(0, "barrier", Message({"trainer": 0, "generation": 1}))
        while client.waiting_for(0, {"barrier": ["", 1]}) != [1]:  # trainer 0 arrived, waits
            time.sleep(0.05)
        assert server.proc is not None
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == -signal.SIGTERM
        with pytest.raises(PSError) as info:
            waiting.result()
    assert info.value.code == "UNAVAILABLE", info.value


MISMATCH = Path(__file__).with_name("launch_mismatch.py")
MARK = "LONGBOAT_TEST_JOB"
#: torch's agent sends SIGTERM to the ranks it stops, and SIGKILL to those alive this long after
KILL_AFTER_S = inspect.signature(PContext.close).parameters["timeout"].default


def _job_processes(mark: str) -> list[int]:
    """The processes whose environment carries ``MARK=mark`` (every process of one launch)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours
            continue
        if f"{MARK}={mark}".encode() in environ:
            found.append(int(entry.name))
    return found


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_a_refused_trainer_ends_the_whole_job_soon(tmp_path: Path) -> None:
    """Trainer models that differ: the server refuses one trainer at connect. The launch ends
    with that message well before the launcher would SIGKILL (the server ends on SIGTERM,
    as its waits for the refused trainer end when it stops), and no process of it survives."""
    mark = uuid.uuid4().hex
    env = {**os.environ, MARK: mark}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "longboat", "launch", "--servers", "1", "--workers", "2",
         str(MISMATCH), str(tmp_path)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = launcher.communicate(timeout=300)
        ended = time.time()
        deadline = time.monotonic() + 10  # the launcher has reaped its ranks; allow stragglers
        while _job_processes(mark) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = _job_processes(mark)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(30)
        _kill(_job_processes(mark))
    assert launcher.returncode != 0, out
    assert "dense_elements: this trainer has" in out, out
    assert "the server has" in out, out
    refused = json.loads((tmp_path / "refused.json").read_text())
    assert "dense_elements" in refused["why"]
    assert survivors == [], f"processes of the job still running: {survivors}\n{out}"
    assert "rank 0 (SIGKILL)" not in out, out  # the server ended on SIGTERM
    assert "rank 0 (SIGTERM)" in out, out
    took = ended - refused["at"]
    assert took < KILL_AFTER_S * 2 / 3, f"the job ended {took:.1f} s after the refusal\n{out}"
