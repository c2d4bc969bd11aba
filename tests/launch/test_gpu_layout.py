"""More NCCL ranks on a node than it has GPUs: one line, before any rank starts.

The GPUs are faked by patching torch.cuda, so these run on a CPU-only machine.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from longboat.launch import gpu_layout, runner
from longboat.launch.options import LaunchOptionError, add_arguments, spec_from_args


@pytest.fixture
def gpus(monkeypatch):
    """Fake ``n`` visible CUDA GPUs (0: CUDA unavailable) and clear the backend override."""

    def fake(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: f"Fake GPU {i}")

    monkeypatch.delenv("LONGBOAT_BACKEND", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return fake


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('trained')\n")
    return "train.py"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture
def nothing_starts(monkeypatch):
    """Fail the test if the launcher gets past its checks (nothing may be spawned)."""
    started: list[object] = []

    def refuse(*args: object, **kwargs: object) -> int:
        started.append(args)
        raise AssertionError("the launcher went on to start ranks")

    monkeypatch.setattr(runner, "launch", refuse)
    monkeypatch.setattr(runner, "run_agent", refuse)
    return started


def test_two_ranks_on_one_gpu_are_refused_before_any_rank_starts(
    gpus, script, nothing_starts, capsys, tmp_path
):
    gpus(1)
    code = runner.run(parse("--nproc-per-node", "2", "--log-dir", "log", script))
    out = capsys.readouterr().out
    assert code == 2
    assert nothing_starts == []
    assert not (tmp_path / "log").exists()
    assert len(out.strip().splitlines()) == 1, out
    assert out.startswith("longboat launch: 2 ranks on this node but torch sees 1 GPU")
    assert "(0: Fake GPU 0)" in out
    assert "--nproc-per-node 1" in out and "LONGBOAT_BACKEND=gloo" in out


def test_visible_devices_are_named(gpus, script, monkeypatch):
    gpus(2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    with pytest.raises(LaunchOptionError, match="torch sees 2 GPUs .* CUDA_VISIBLE_DEVICES=2,3"):
        spec_from_args(parse("--nproc-per-node", "4", script))


@pytest.mark.parametrize(
    ("visible", "argv", "env"),
    [
        (2, ["--nproc-per-node", "2"], {}),  # one rank per GPU
        (1, ["--nproc-per-node", "2"], {"LONGBOAT_BACKEND": "gloo"}),  # ranks share the GPU
        (0, ["--nproc-per-node", "4"], {}),  # no CUDA: the ranks choose gloo
        (1, ["--servers", "1", "--workers", "1"], {}),  # PS roles are not checked
    ],
)
def test_layouts_that_can_run_are_left_alone(gpus, script, monkeypatch, visible, argv, env):
    gpus(visible)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert spec_from_args(parse(*argv, script)).target == script


def test_nccl_asked_for_without_a_gpu_is_refused(gpus, monkeypatch):
    gpus(0)
    monkeypatch.setenv("LONGBOAT_BACKEND", "nccl")
    monkeypatch.setattr(torch.distributed, "is_backend_available", lambda name: True)
    problem = gpu_layout.gpu_layout_problem(1)
    assert problem is not None
    assert "LONGBOAT_BACKEND=nccl but torch sees no GPU" in problem
    assert "LONGBOAT_BACKEND=gloo" in problem
