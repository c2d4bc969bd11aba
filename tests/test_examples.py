"""Every example in examples/ runs in CI at small size, as its docstring shows it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

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
    "fleet_collective.py": (
        [*LAUNCH, "--nproc-per-node", "2"],
        ["--steps", "10", "--hid-dim", "64", "--model-path", "{tmp}/model"],
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
