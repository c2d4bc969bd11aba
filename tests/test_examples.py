"""Every example in examples/ runs in CI at small size, as its docstring shows it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # slow tier: every example end to end through its launcher

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
LAUNCH = [sys.executable, "-m", "longboat", "launch"]

# example -> (command before the script, arguments after it); {tmp} is the test's directory
RUNS: dict[str, tuple[list[str], list[str]]] = {
    "ddp_digits.py": (
        [*LAUNCH, "--nproc-per-node", "2"],
        ["--epochs", "3", "--checkpoint", "{tmp}/ck.pt"],
    ),
    "horovod_mnist_style.py": ([*LAUNCH, "-np", "2", "-H", "localhost:2"], ["--epochs", "3"]),
    "elastic_train.py": (
        [*LAUNCH, "--nproc-per-node", "2"],
        ["--epochs", "3", "--checkpoint", "{tmp}/ck.pt"],
    ),
    "fleet_collective.py": (
        [*LAUNCH, "--nproc-per-node", "2"],
        ["--steps", "10", "--hid-dim", "64", "--model-path", "{tmp}/model"],
    ),
    "kvstore_digits.py": (
        [*LAUNCH, "--servers", "1", "--workers", "2"],
        ["--kvstore", "dist_sync", "--update-on-kvstore", "0", "--save", "{tmp}/dist.pt"],
    ),
}


def _run(tmp_path: Path, command: list[str], name: str, args: list[str]) -> str:
    argv = [*command, str(EXAMPLES / name), *(a.format(tmp=tmp_path) for a in args)]
    done = subprocess.run(
        argv, cwd=tmp_path, capture_output=True, text=True, timeout=240, env=_env()
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


RUN_ELSEWHERE = {"ps_ctr.py": "tests/ps/test_example.py"}  # example -> the test that runs it


def test_every_example_is_run_here():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted({*RUNS, *RUN_ELSEWHERE})
    for test in RUN_ELSEWHERE.values():
        assert (ROOT / test).is_file()


def test_ddp_digits_learns_and_checkpoints(tmp_path):
    command, args = RUNS["ddp_digits.py"]
    out = _run(tmp_path, command, "ddp_digits.py", args)
    accuracy = [float(a) for a in re.findall(r"val accuracy ([0-9.]+)", out)]
    assert len(accuracy) == 3 and accuracy[-1] > 0.8, out[-2000:]
    state = torch.load(tmp_path / "ck.pt", weights_only=True)
    assert state["epoch"] == 2 and "conv1.weight" in state["model"]


def test_ddp_digits_resumes_from_its_checkpoint(tmp_path):
    """Run again with the same --checkpoint and more epochs: it goes on, it does not restart."""
    command, _ = RUNS["ddp_digits.py"]
    first = ["--epochs", "1", "--checkpoint", "{tmp}/ck.pt"]
    assert "resumed" not in _run(tmp_path, command, "ddp_digits.py", first)
    out = _run(tmp_path, command, "ddp_digits.py", ["--epochs", "2", "--checkpoint", "{tmp}/ck.pt"])
    assert "resumed from" in out and "after epoch 0" in out, out[-2000:]
    assert re.findall(r"epoch (\d+): train loss", out) == ["1"], out[-2000:]
    assert torch.load(tmp_path / "ck.pt", weights_only=True)["epoch"] == 1


def test_ddp_digits_runs_unchanged_on_one_process(tmp_path):
    out = _run(tmp_path, [sys.executable], "ddp_digits.py", ["--epochs", "1"])
    assert re.search(r"epoch 0: train loss [0-9.]+  val accuracy", out), out[-2000:]


def test_horovod_script_under_horovodrun_flags(tmp_path):
    command, args = RUNS["horovod_mnist_style.py"]
    out = _run(tmp_path, command, "horovod_mnist_style.py", args)
    accuracy = [float(a) for a in re.findall(r"Accuracy: ([0-9.]+)%", out)]
    assert len(accuracy) == 3 and accuracy[-1] > 40.0, out[-2000:]


def test_fleet_collective_trains_and_saves(tmp_path):
    command, args = RUNS["fleet_collective.py"]
    out = _run(tmp_path, command, "fleet_collective.py", args)
    assert "worker 0 of 2" in out and "step0 cost=" in out
    state = torch.load(tmp_path / "model" / "persistables.pt", weights_only=True)
    assert set(state) == {"model", "optimizer"}


def test_kvstore_on_servers_equals_one_local_process(tmp_path):
    """2 workers + 1 server (servers only sum gradients) against the local store on the
    whole global batch in one process."""
    command, args = RUNS["kvstore_digits.py"]
    out = _run(tmp_path, command, "kvstore_digits.py", args)
    server_log = (tmp_path / "log" / "serverlog.0").read_text()
    assert "every trainer stopped" in server_log, server_log  # the server ended with the workers
    assert "worker 0/2 epoch 2" in out, out[-2000:]  # the console shows trainer 0
    local = ["--kvstore", "local", "--update-on-kvstore", "0", "--save", "{tmp}/local.pt"]
    out = _run(tmp_path, [sys.executable], "kvstore_digits.py", local)
    accuracy = [float(a) for a in re.findall(r"test accuracy ([0-9.]+)", out)]
    assert len(accuracy) == 3 and accuracy[-1] > 0.7, out[-2000:]
    dist, single = (torch.load(tmp_path / f, weights_only=True) for f in ("dist.pt", "local.pt"))
    for key, value in single.items():
        torch.testing.assert_close(dist[key], value, rtol=1e-5, atol=1e-5)


def test_elastic_example_trains_and_resumes_from_its_checkpoint(tmp_path):
    command, args = RUNS["elastic_train.py"]
    out = _run(tmp_path, command, "elastic_train.py", args)
    accuracy = [float(a) for a in re.findall(r"accuracy ([0-9.]+)", out)]
    assert len(accuracy) == 3 and accuracy[-1] > 0.7, out[-2000:]
    more = ["--epochs", "4", "--checkpoint", "{tmp}/ck.pt"]
    out = _run(tmp_path, command, "elastic_train.py", more)
    assert "resumed from" in out and "at epoch 3" in out, out[-2000:]
