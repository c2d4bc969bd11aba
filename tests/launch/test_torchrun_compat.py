"""torchrun's flag spellings, validation before any rank starts, and the final line."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from longboat.launch.options import add_arguments
from longboat.launch.ports import free_port
from tests.launch._launcher import run_launcher

PROBE = """\
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
print(f"MASTER_PORT={os.environ['MASTER_PORT']}", flush=True)
dist.destroy_process_group()
"""

PORT = "{port}"  # replaced by a free port in each test

SPELLINGS = {
    "master-port": (["--master-port", PORT, "--nproc-per-node", "2"], {}),
    "underscores": (
        [
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            PORT,
            "--nnodes",
            "1",
            "--node_rank",
            "0",
            "--nproc_per_node",
            "2",
        ],
        {},
    ),
    "master-addr": (
        ["--master-addr", "127.0.0.1", "--master-port", PORT, "--node-rank", "0"]
        + ["--nproc-per-node", "2"],
        {},
    ),
    "rdzv-endpoint": (["--rdzv-endpoint", f"127.0.0.1:{PORT}", "--nproc-per-node", "2"], {}),
    "rdzv_endpoint": (["--rdzv_endpoint", f"127.0.0.1:{PORT}", "--nproc_per_node", "2"], {}),
    "environment": (
        ["--nproc-per-node", "2"],
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": PORT},
    ),
}


DASHED = (
    ["--nproc-per-node", "2", "--num-proc", "2", "--node-rank", "0", "--master-addr", "h"]
    + ["--master-port", "29500", "--log-dir", "l", "--max-restarts", "1", "--server-num", "1"]
    + ["--worker-num", "1", "--rdzv-endpoint", "h:1", "x.py"]
)


def test_underscore_twins_parse_alike_and_help_lists_dashes():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    underscored = ["--" + a[2:].replace("-", "_") if a.startswith("--") else a for a in DASHED]
    assert parser.parse_args(underscored) == parser.parse_args(DASHED)
    shown = parser.format_help()
    assert "--master-port" in shown and not re.search(r"--[a-z]+_", shown)


@pytest.fixture
def probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    return path


def ports_seen(stdout: str) -> set[str]:
    return set(re.findall(r"MASTER_PORT=(\d+)", stdout))


@pytest.mark.parametrize(
    "name",
    [  # one spelling of each kind in the quick tier (the parser test covers every one)
        n if n in ("environment", "rdzv_endpoint") else pytest.param(n, marks=pytest.mark.slow)
        for n in SPELLINGS
    ],
)
def test_torchrun_spelling_uses_the_given_port(tmp_path, probe, monkeypatch, name):
    port = str(free_port())
    flags, env = SPELLINGS[name]
    for var, value in env.items():
        monkeypatch.setenv(var, value.replace(PORT, port))
    args = [f.replace(PORT, port) for f in flags]
    done = run_launcher(tmp_path, *args, str(probe))
    assert done.returncode == 0, done.stdout + done.stderr
    assert ports_seen(done.stdout) == {port}, done.stdout


def test_standalone_ignores_the_environment_and_prints_the_final_line(tmp_path, probe, monkeypatch):
    taken = str(free_port())
    monkeypatch.setenv("MASTER_PORT", taken)
    done = run_launcher(tmp_path, "--standalone", "--nproc-per-node", "2", str(probe))
    assert done.returncode == 0, done.stdout + done.stderr
    seen = ports_seen(done.stdout)
    assert len(seen) == 1 and taken not in seen, done.stdout
    last = done.stdout.splitlines()[-1]
    assert re.fullmatch(
        r"longboat launch: job finished successfully: 2 ranks, \d+\.\d s, logs in log/", last
    ), last


BAD_INPUTS = {
    "unknown field": ({"strategy.yaml": "nccl_comm_nu: 2\n"}, {}, "did you mean 'nccl_comm_num'"),
    "bad yaml": ({"strategy.yaml": "nccl_comm_num: [2\n"}, {}, "not valid yaml"),
    "bad value": ({"strategy.yaml": "nccl_comm_num: 0\n"}, {}, "Strategy.nccl_comm_num"),
    "bad variable": ({}, {"LONGBOAT_NCCL_COMM_NUM": "x"}, "LONGBOAT_NCCL_COMM_NUM='x'"),
    "zero ranks": ({}, {"nproc": "0"}, "--nproc-per-node must be >= 1, got 0"),
    "negative ranks": ({}, {"nproc": "-2"}, "--nproc-per-node must be >= 1, got -2"),
    "bad MASTER_PORT": ({}, {"MASTER_PORT": "http"}, "MASTER_PORT='http'"),
    "missing GPUs": ({}, {"gpus": "0,99"}, "--gpus 0,99: "),  # no GPU here, or no GPU 99
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_is_one_line_before_any_rank(tmp_path, probe, monkeypatch, name):
    files, env, expected = BAD_INPUTS[name]
    env = dict(env)
    gpus = env.pop("gpus", None)
    args = ["--gpus", gpus] if gpus else ["--nproc-per-node", env.pop("nproc", "2")]
    for file, text in files.items():
        (tmp_path / file).write_text(text)
        args += ["--config", str(tmp_path / file)]
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    done = run_launcher(tmp_path, *args, str(probe))
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("longboat launch: "), done.stdout
    assert expected in lines[0], lines[0]
    assert not (tmp_path / "log").exists()
