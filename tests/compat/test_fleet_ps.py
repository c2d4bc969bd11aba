"""longboat.fleet in parameter-server mode: Paddle's flow (init_server / run_server /
init_worker / distributed_optimizer / minimize / stop_worker) in real launched processes,
against single-process training on the same global batch; misuse is named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import longboat as lb
from longboat.fleet.base import Fleet, FleetError
from longboat.fleet.role_maker import Role, UserDefinedRoleMaker
from tests.collective import _workloads as W

SCRIPT = Path(__file__).with_name("fleet_ps_train.py")


def _launch(tmp_path: Path, mode: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "longboat", "launch", "--servers", "2", "--workers", "2",
         str(SCRIPT), str(tmp_path), mode],
        cwd=tmp_path, capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    logs = "".join(p.read_text() for p in sorted(tmp_path.glob("log/*log.*")))
    assert done.returncode == 0, done.stdout + done.stderr + logs
    return logs


@pytest.mark.slow  # a whole end-to-end run: the slow tier (CI runs it after the quick one)
def test_sync_flow_equals_global_batch_and_servers_end_after_stop_worker(tmp_path):
    logs = _launch(tmp_path, "sync")
    cfg = W.Config()
    model = W.build_model(cfg, seed=0)
    want = W.train_global_batch(model, W.build_optimizer(cfg, model), cfg, 2)
    for rank in range(2):
        got = torch.load(tmp_path / f"trainer{rank}.pt", weights_only=True)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)
    saved = torch.load(tmp_path / "persistables.pt", weights_only=True)["model"]
    torch.testing.assert_close(dict(saved), dict(model.state_dict()), rtol=1e-5, atol=1e-5)
    # each server's run_server ended because every worker called stop_worker (the launcher's
    # own end-of-job stop of servers comes later and logs nothing)
    assert logs.count("every trainer stopped") == 2, logs


def _fleet(role: Role, **kwargs) -> Fleet:
    f = Fleet()
    f.init(UserDefinedRoleMaker(role=role, server_endpoints=["127.0.0.1:1"], **kwargs))
    return f


def test_misuse_is_named():
    worker = _fleet(Role.WORKER, worker_num=1)
    with pytest.raises(FleetError, match="server process"):
        worker.init_server()
    with pytest.raises(FleetError, match="before fleet.distributed_model"):
        worker.distributed_model(torch.nn.Linear(2, 2))
    server = _fleet(Role.SERVER)
    with pytest.raises(FleetError, match="worker process"):
        server.init_worker()
    with pytest.raises(FleetError, match="worker process"):
        server.distributed_optimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), 0.1))
    collective = Fleet()
    collective.init(UserDefinedRoleMaker(is_collective=True, worker_num=1))  # joins: lb.init
    try:
        with pytest.raises(FleetError, match="parameter-server mode"):
            collective.run_server()
    finally:
        lb.shutdown()  # the next tests must not see this process as a cluster member
