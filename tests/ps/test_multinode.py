"""Parameter servers and trainers on different emulated nodes (`longboat emulate --server-nodes`):
the job-wide layout, binding to the node's address, the shared token, and sync training equal
to single-process training on the global batch.

Needs root and iproute2 (skipped otherwise); every run's namespaces and processes are removed
even when a test fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from longboat.launch import emulate, netns
from longboat.ps.shared.auth import generate_token
from tests.collective import _workloads as W
from tests.launch.test_emulate import _leftovers, _processes_mentioning, needs_netns, run_id

__all__ = ["run_id"]  # the fixture, used by name

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(120),
    needs_netns,
]  # slow tier: parameter servers across emulated nodes

SCRIPT = Path(__file__).with_name("multinode_train.py")


def emulate_ps(
    run_id: str, out: Path, *extra: str, script_args: tuple[str, ...] = (), timeout: int = 90
) -> list[str]:
    """`longboat emulate`: 2 server nodes (1 server each), 2 trainer nodes (1 trainer each)."""
    return [
        sys.executable, "-m", "longboat", "emulate", "--nodes", "4", "--server-nodes", "2",
        "--servers", "2", "--workers", "2", "--run-id", run_id, "--timeout", str(timeout),
        "--log-dir", str(out / "logs"), *extra, "--", str(SCRIPT), str(out), *script_args,
    ]  # fmt: skip


def run_emulated(
    cmd: list[str], out: Path, timeout: int = 110, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``cmd``; on a failure the assertion message carries the console and every rank log."""
    env = {**os.environ, **(env or {})}
    try:
        done = subprocess.run(
            cmd, cwd=out, capture_output=True, text=True, timeout=timeout, env=env
        )
    finally:
        assert not _processes_mentioning(str(out)), "processes of the run are still alive"
    logs = "".join(
        f"\n== {p}\n{p.read_text(errors='replace')}" for p in sorted(out.glob("logs/node*/*log.*"))
    )
    assert done.returncode == 0, done.stdout + done.stderr + logs
    return done


def assert_global_batch(out: Path) -> None:
    """Both trainers end with the parameters of single-process training on the global batch."""
    cfg = W.Config()
    model = W.build_model(cfg, seed=0)
    want = W.train_global_batch(model, W.build_optimizer(cfg, model), cfg, 2)
    for rank in range(2):
        got = torch.load(out / f"trainer{rank}.pt", weights_only=True)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)


def test_servers_and_trainers_on_separate_nodes(run_id: str, tmp_path: Path) -> None:
    done = run_emulated(emulate_ps(run_id, tmp_path), tmp_path)
    assert _leftovers(run_id) == []
    assert_global_batch(tmp_path)
    seen = [json.loads((tmp_path / f"seen{r}.json").read_text()) for r in range(2)]
    servers = seen[0]["servers"]
    # job-wide layout on every node: servers of nodes 0 and 1, trainers on nodes 2 and 3
    assert [s["servers"] for s in seen] == [servers, servers]
    assert [s["trainers"] for s in seen] == [2, 2]
    assert sorted((s["trainer"], s["node"]) for s in seen) == [(0, 2), (1, 3)]
    assert seen[0]["endpoints"] == seen[1]["endpoints"] and len(seen[0]["endpoints"]) == 2
    hosts = [ep.rpartition(":")[0] for ep in servers]
    assert len(set(hosts)) == 2 and not any(h.startswith("127.") for h in hosts)
    # a caller on another node with a wrong or no token is refused by every server
    for s in seen:
        assert s["wrong"] == ["UNAUTHENTICATED"] * 2, s
        assert s["missing"] == ["UNAUTHENTICATED"] * 2, s
    # every node's banner lists every server endpoint of the job
    for node in range(4):
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith(f"[node {node}]")]
        assert all(any(ep in ln for ln in lines) for ep in servers), (node, done.stdout)


def test_killed_server_is_restarted_and_sync_training_loses_nothing(
    run_id: str, tmp_path: Path
) -> None:
    """Server 1 (node 1) SIGKILLs itself once it has applied 5 steps; its launcher restarts it
    (--max-restarts) from its step-4 checkpoint on the same endpoint; the trainers wait, roll
    every server back to step 4, replay their logged pushes and finish equal to single-process
    training: no update is lost."""
    env = {
        "LONGBOAT_PS_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
        "LONGBOAT_PS_CHECKPOINT_EVERY": "2",
    }
    cmd = emulate_ps(run_id, tmp_path, "--max-restarts", "1", script_args=("1@5",))
    done = run_emulated(cmd, tmp_path, env=env)
    assert _leftovers(run_id) == []
    assert_global_batch(tmp_path)
    servers = json.loads((tmp_path / "seen0.json").read_text())["servers"]
    restarted = (tmp_path / "logs/node1/serverlog.0").read_text()
    assert "server 1 restored from" in restarted and "at step 4" in restarted, restarted
    assert f"listening on {servers[1]}" in restarted  # the same endpoint as before
    assert (tmp_path / "logs/node1/serverlog.0.attempt0").exists()
    for node in (2, 3):
        log = (tmp_path / f"logs/node{node}/workerlog.0").read_text()
        assert f"parameter server 1 ({servers[1]}) failed" in log, log
        # rolled back to the step-4 checkpoint; steps 4.. replayed (where the trainer noticed)
        assert re.search(r"replayed steps 4\.\.[45] ", log), log
    assert "restart" in done.stdout


def test_paddle_style_endpoint_lists_on_emulated_nodes(
    run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Every node gets the same `--servers ip:port,... --workers ip:port,...` and runs its own
    entries on the listed ports; the job's server list is the one given."""
    monkeypatch.setenv("LONGBOAT_PS_TOKEN", generate_token())
    monkeypatch.chdir(tmp_path)
    listed: list[str] = []

    def paddle_style(
        plan: netns.Plan, node: netns.Node, args: argparse.Namespace, log_dir: Path, master: str
    ) -> list[str]:
        ips = [n.address for n in plan.nodes]
        listed[:] = [f"{ip}:6170" for ip in ips[:2]]
        workers = ",".join(f"{ip}:6171" for ip in ips[2:])
        return [
            sys.executable, "-m", "longboat", "launch", "--servers", ",".join(listed),
            "--workers", workers, "--master", f":{args.master_port}",
            "--log-dir", str(log_dir / f"node{node.index}"), str(SCRIPT), str(tmp_path),
        ]  # fmt: skip

    parser = argparse.ArgumentParser()
    emulate.add_arguments(parser)
    args = parser.parse_args(
        ["--nodes", "4", "--run-id", run_id, "--timeout", "90", "--log-dir",
         str(tmp_path / "logs"), "--", str(SCRIPT)]
    )  # fmt: skip
    code = emulate.run(args, node_command=paddle_style)
    out = capsys.readouterr().out
    assert code == 0, out[-4000:]
    assert _leftovers(run_id) == [] and not _processes_mentioning(str(tmp_path))
    assert_global_batch(tmp_path)
    seen = [json.loads((tmp_path / f"seen{r}.json").read_text()) for r in range(2)]
    assert [s["servers"] for s in seen] == [listed, listed]
    assert sorted(s["node"] for s in seen) == [2, 3]


def test_a_job_without_any_server_stops_with_the_reason(
    run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Two trainer-only nodes: every rank stops at start-up and the summary names why."""
    monkeypatch.setenv("LONGBOAT_PS_TOKEN", generate_token())
    monkeypatch.chdir(tmp_path)

    def trainers_only(
        plan: netns.Plan, node: netns.Node, args: argparse.Namespace, log_dir: Path, master: str
    ) -> list[str]:
        launcher = emulate.launcher_command(plan, node, args, log_dir, master=master)
        at = launcher.index("--nproc-per-node")
        return [*launcher[:at], "--servers", "0", "--workers", "1", *launcher[at + 2 :]]

    parser = argparse.ArgumentParser()
    emulate.add_arguments(parser)
    args = parser.parse_args(
        ["--nodes", "2", "--run-id", run_id, "--timeout", "60", "--log-dir",
         str(tmp_path / "logs"), "--", str(SCRIPT), str(tmp_path)]
    )  # fmt: skip
    code = emulate.run(args, node_command=trainers_only)
    out = capsys.readouterr().out
    assert code != 0
    assert "the job has 0 servers and 2 trainers over all nodes: no server" in out, out[-4000:]
    assert "workerlog.0" in out  # the summary points at this node's own log
    assert _leftovers(run_id) == [] and not _processes_mentioning(str(tmp_path))


def test_nodes_with_both_roles(
    run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Two nodes running a server and a trainer each: servers of both nodes come first."""
    monkeypatch.setenv("LONGBOAT_PS_TOKEN", generate_token())
    monkeypatch.chdir(tmp_path)

    def both_roles(
        plan: netns.Plan, node: netns.Node, args: argparse.Namespace, log_dir: Path, master: str
    ) -> list[str]:
        launcher = emulate.launcher_command(plan, node, args, log_dir, master=master)
        at = launcher.index("--nproc-per-node")
        return [*launcher[:at], "--servers", "1", "--workers", "1", *launcher[at + 2 :]]

    parser = argparse.ArgumentParser()
    emulate.add_arguments(parser)
    args = parser.parse_args(
        ["--nodes", "2", "--run-id", run_id, "--timeout", "90", "--log-dir",
         str(tmp_path / "logs"), "--", str(SCRIPT), str(tmp_path)]
    )  # fmt: skip
    code = emulate.run(args, node_command=both_roles)
    out = capsys.readouterr().out
    assert code == 0, out[-4000:]
    assert _leftovers(run_id) == [] and not _processes_mentioning(str(tmp_path))
    assert_global_batch(tmp_path)
    seen = [json.loads((tmp_path / f"seen{r}.json").read_text()) for r in range(2)]
    assert seen[0]["servers"] == seen[1]["servers"]
    hosts = [ep.rpartition(":")[0] for ep in seen[0]["servers"]]
    trainer_hosts = [ep.rpartition(":")[0] for ep in seen[0]["endpoints"]]
    assert hosts[0] != hosts[1] and hosts == trainer_hosts  # node 0's server and trainer first
    assert [(s["trainer"], s["node"]) for s in sorted(seen, key=lambda s: s["trainer"])] == [
        (0, 0),
        (1, 1),
    ]
