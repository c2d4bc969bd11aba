"""`longboat emulate` fault injection: parsing, planning, and faults fired on real namespaces.

The netns tests run a stub node command (`fault_probe.py`, no torch, no training) that writes
step counts where an elastic rank would, so they exercise emulate's part only. Each uses its
own run id and removes everything named after it, whatever happened.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from longboat.launch import emulate, emulate_nodes, faults, netns
from longboat.launch.faults import Fault, FaultError, When
from tests.launch.test_emulate import _leftovers, _processes_mentioning, needs_netns

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(120),
]  # slow tier: fault injection across emulated nodes

PROBE = Path(__file__).with_name("fault_probe.py")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    emulate.add_arguments(parser)
    return parser.parse_args(list(argv))


def _plan(nodes: int, spares: int = 0, elastic: bool = False) -> netns.Plan:
    return netns.Plan(
        "abc123",
        "lbemabc123b",
        ipaddress.ip_network("10.1.2.0/24"),
        tuple(
            netns.Node(
                i, f"lbemabc123-node{i}", f"lbemabc123n{i}", f"lbemabc123h{i}", f"10.1.2.{i + 1}"
            )
            for i in range(nodes + spares)
        ),
        10**9,
        125_000,
        None,
        spares,
        "10.1.2.254" if elastic else None,
    )


# ---------------------------------------------------------------- parsing and validation


def test_parse_when_and_faults() -> None:
    assert faults.parse_when("10s") == When(seconds=10.0)
    assert faults.parse_when("2.5s") == When(seconds=2.5)
    assert faults.parse_when("step=5") == When(step=5)
    assert faults.parse_fault("kill", "2@step=5") == Fault("kill", 2, When(step=5))
    assert faults.parse_fault("cut", "1@3s") == Fault("cut", 1, When(seconds=3.0))
    assert faults.parse_fault("add", "4s") == Fault("add", None, When(seconds=4.0))
    assert When(step=5).due(0.0, 5) and not When(step=5).due(99.0, 4)
    assert When(seconds=2).due(2.0, -1) and not When(seconds=2).due(1.9, 100)


@pytest.mark.parametrize(
    ("kind", "text", "message"),
    [
        ("kill", "1@soon", r"--kill-node 1@soon.*'soon' is not a time such as 10s"),
        ("kill", "1", r"'--kill-node 1' is not NODE@WHEN"),
        ("cut", "x@3s", r"'--cut-link x@3s' is not NODE@WHEN"),
        ("add", "10", r"--add-node 10.*step such as step=5"),
        ("add", "step=-1", r"--add-node step=-1"),
    ],
)
def test_malformed_fault_is_named(kind: str, text: str, message: str) -> None:
    with pytest.raises(FaultError, match=message):
        faults.parse_fault(kind, text)


def test_plan_faults_validation() -> None:
    assert not faults.plan_faults(3).elastic  # no flags: static, as before
    assert faults.plan_faults(3, min_nodes=2).max_nodes == 3
    plan = faults.plan_faults(3, kill=["1@5s"], add=["step=2", "8s"])
    assert (plan.elastic, plan.min_nodes, plan.spares, plan.max_nodes) == (True, 1, 2, 5)
    assert faults.plan_faults(2, kill=["3@1s"], add=["1s", "2s"]).max_nodes == 4  # added node
    with pytest.raises(FaultError, match=r"--min-nodes 3 must be between 1 and --nodes \(2\)"):
        faults.plan_faults(2, min_nodes=3)
    with pytest.raises(FaultError, match="--min-nodes 0"):
        faults.plan_faults(2, min_nodes=0, kill=["1@1s"])
    with pytest.raises(FaultError, match=r"'--kill-node 2@1s': there is no node 2; nodes are 0..1"):
        faults.plan_faults(2, kill=["2@1s"])
    with pytest.raises(FaultError, match=r"'--restore-link 1@5s' has no earlier --cut-link 1@"):
        faults.plan_faults(2, restore=["1@5s"])
    with pytest.raises(FaultError, match="--restore-link 1@5s"):
        faults.plan_faults(2, cut=["1@6s", "0@1s"], restore=["1@5s"])  # the cut comes later
    with pytest.raises(FaultError, match="--restore-link 1@step=4"):
        faults.plan_faults(2, cut=["1@step=4"], restore=["1@step=4"])
    ok = faults.plan_faults(2, cut=["1@step=2", "1@8s"], restore=["1@step=4", "1@9s"])
    assert ok.elastic and ok.spares == 0


def test_highest_step_skips_missing_and_partial(tmp_path: Path) -> None:
    a, b, missing = tmp_path / "a", tmp_path / "b", tmp_path / "missing"
    a.mkdir()
    b.mkdir()
    assert faults.highest_step([a, missing]) == -1
    (a / "commits-0").write_text("7")
    (a / "commits-1").write_text("")  # being written
    (b / "commits-0").write_text("12\n")
    (b / "commits-1").write_text("1x")
    assert faults.highest_step([a, b, missing]) == 12


def test_an_added_node_is_said_to_join_once_its_ranks_commit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Starting a node is not its joining: the job takes it in at a later commit, which its
    ranks' first recorded commit tells."""
    plan = _plan(2, spares=1, elastic=True)
    started: list[netns.Node] = []

    def start(node: netns.Node) -> Any:  # a run without a process
        started.append(node)
        return SimpleNamespace(node=node, faulted=None)

    injector = emulate_nodes.Injector(
        plan, faults.plan_faults(2, add=["step=2"]), tmp_path, start=start
    )
    node0, node2 = (tmp_path / f"node{i}" / ".elastic" for i in (0, 2))
    node0.mkdir(parents=True)
    (node0 / "commits-0").write_text("2")
    runs: list = []
    injector.poll(runs)
    assert [n.index for n in started] == [2]
    out = capsys.readouterr().out
    assert (
        "[emulate] started node 2 at step 2 (" in out and "joins the job at a later commit" in out
    )
    (node0 / "commits-0").write_text("5")
    injector.poll(runs)
    assert "joined" not in capsys.readouterr().out  # started, not yet in the job
    node2.mkdir(parents=True)
    (node2 / "commits-0").write_text("6")
    injector.poll(runs)
    injector.poll(runs)
    assert capsys.readouterr().out == "[emulate] node 2 joined the job by commit 6\n"


def test_bad_fault_flag_exits_2_naming_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(emulate, "check_environment", lambda need_tc=True: None)
    args = _args("--nodes", "2", "--restore-link", "1@5s", "--", str(PROBE))
    with caplog.at_level(logging.ERROR, logger="longboat.emulate"):
        assert emulate.run(args) == 2
    assert "'--restore-link 1@5s' has no earlier --cut-link" in caplog.text
    args = _args("--nodes", "2", "--kill-node", "1@later", "--", str(PROBE))
    with caplog.at_level(logging.ERROR, logger="longboat.emulate"):
        assert emulate.run(args) == 2
    assert "'later' is not a time such as 10s or 2.5s, or a step such as step=5" in caplog.text


# ---------------------------------------------------------------- planning


def test_elastic_plan_has_spares_and_a_free_bridge_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns, "_used_networks", lambda: [])
    plan = netns.make_plan(3, 10**9, run_id="abc123", spares=2, bridge_address=True)
    assert len(plan.nodes) == 5 and [n.index for n in plan.initial_nodes] == [0, 1, 2]
    assert plan.bridge_address == str(list(plan.subnet.hosts())[-1])
    assert plan.bridge_address not in {n.address for n in plan.nodes}
    assert len({n.address for n in plan.nodes}) == 5
    static = netns.make_plan(3, 10**9, run_id="abc123")
    assert static.bridge_address is None and static.spares == 0
    assert netns.make_plan(254, 10**9, run_id="abc123").nodes[-1].address.endswith(".254")
    with pytest.raises(ValueError, match="between 1 and 253"):
        netns.make_plan(254, 10**9, run_id="abc123", bridge_address=True)
    with pytest.raises(ValueError, match="exceed 253 nodes"):
        netns.make_plan(250, 10**9, run_id="abc123", spares=4, bridge_address=True)


def test_elastic_launcher_command() -> None:
    args = _args(
        "--nodes", "2", "--nproc-per-node", "2", "--kill-node", "1@step=3", "--add-node", "4s",
        "--", "train.py", "--lr", "1",
    )  # fmt: skip
    schedule = emulate.fault_plan(args)
    assert (schedule.min_nodes, schedule.max_nodes) == (1, 3)
    plan = _plan(2, spares=schedule.spares, elastic=schedule.elastic)
    for node in plan.nodes:
        cmd = emulate.launcher_command(plan, node, args, Path("/logs"))
        assert cmd[1:] == [
            "-m", "longboat", "launch", "--nnodes", "1:3", "--nproc-per-node", "2",
            "--master", "10.1.2.254:29500", "--log-dir", f"/logs/node{node.index}",
            "train.py", "--lr", "1",
        ]  # fmt: skip
        assert "--node-rank" not in cmd
    cmd = emulate.launcher_command(plan, plan.nodes[0], args, Path("/l"), master="10.1.2.254:7")
    assert "10.1.2.254:7" in cmd
    args.min_nodes = 2
    assert "2:3" in emulate.launcher_command(plan, plan.nodes[2], args, Path("/logs"))
    env = emulate.node_env(plan, plan.nodes[2])
    assert "LONGBOAT_NODE_RANK" not in env and "LONGBOAT_NNODES" not in env
    assert env["GLOO_SOCKET_IFNAME"] == "lbemabc123n2"
    args.launcher = "torchrun"
    torchrun = emulate.launcher_command(plan, plan.nodes[1], args, Path("/logs"))
    assert "--rdzv-backend" in torchrun and "--node-rank" not in torchrun and "2:3" in torchrun


def test_static_launcher_command_unchanged() -> None:
    args = _args("--nodes", "2", "--", "train.py")
    assert not emulate.fault_plan(args).elastic
    cmd = emulate.launcher_command(_plan(2), _plan(2).nodes[1], args, Path("/logs"))
    assert cmd[4:10] == ["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1"]
    assert cmd[cmd.index("--master") + 1] == "10.1.2.1:29500"


# ---------------------------------------------------------------- real namespaces


@pytest.fixture
def fault_run_id() -> Iterator[str]:
    """A fresh run id; afterwards nothing named after it remains."""
    rid = secrets.token_hex(3)
    yield rid
    netns.cleanup_stale(f"{netns.PREFIX}{rid}", include_live=True)


def _stub(steps: int) -> emulate.NodeCommand:
    """Each node runs fault_probe.py, printing the launcher command emulate built for it."""

    def command(
        plan: netns.Plan, node: netns.Node, args: argparse.Namespace, log_dir: Path, master: str
    ) -> list[str]:
        launcher = emulate.launcher_command(plan, node, args, log_dir, master=master)
        probe = [sys.executable, str(PROBE), "--log-dir", str(log_dir / f"node{node.index}")]
        return [*probe, "--steps", str(steps), "--", *launcher]

    return command


def _commits(log_dir: Path, node: int) -> int:
    return faults.highest_step([log_dir / f"node{node}" / ".elastic"])


@needs_netns
def test_kill_on_step_and_add_node(
    fault_run_id: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log_dir = tmp_path / "logs"
    args = _args(
        "--nodes", "2", "--run-id", fault_run_id, "--log-dir", str(log_dir), "--timeout", "60",
        "--kill-node", "1@step=3", "--add-node", "step=2",
        "--", str(PROBE),
    )  # fmt: skip
    code = emulate.run(args, node_command=_stub(steps=15))
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    killed = [line for line in out.splitlines() if line.startswith("[emulate] killed node 1 at")]
    assert len(killed) == 1 and int(killed[0].split("at step ")[1].split()[0]) >= 3, out
    assert "[emulate] started node 2 at step" in out
    assert "[emulate] node 2 joined the job by commit " in out
    launchers = [line for line in out.splitlines() if "probe launcher:" in line]
    assert launchers and all("--nnodes 1:3" in line for line in launchers)
    assert not any("--node-rank" in line for line in launchers)
    assert "[node 2] probe step 15" in out
    assert _commits(log_dir, 0) == 15 and _commits(log_dir, 2) == 15
    assert _commits(log_dir, 1) < 15  # killed on the way
    assert _leftovers(fault_run_id) == []
    assert _processes_mentioning(str(log_dir)) == []


def _link_up(namespace: str, ifname: str) -> bool | None:
    """Whether ``ifname`` in ``namespace`` is administratively up (None: gone)."""
    done = subprocess.run(
        ["ip", "-n", namespace, "-o", "link", "show", ifname], capture_output=True, text=True
    )
    if done.returncode != 0:
        return None
    flags = done.stdout.split("<", 1)[1].split(">", 1)[0].split(",")
    return "UP" in flags


@needs_netns
def test_cut_and_restore_toggle_the_link(
    fault_run_id: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log_dir = tmp_path / "logs"
    args = _args(
        "--nodes", "2", "--run-id", fault_run_id, "--log-dir", str(log_dir), "--timeout", "60",
        "--cut-link", "1@step=3", "--restore-link", "1@step=10",
        "--", str(PROBE),
    )  # fmt: skip
    result: list[int] = []
    runner = threading.Thread(
        target=lambda: result.append(emulate.run(args, node_command=_stub(steps=16)))
    )
    namespace, ifname = f"{netns.PREFIX}{fault_run_id}-node1", f"{netns.PREFIX}{fault_run_id}n1"
    states: list[bool] = []
    runner.start()
    try:
        while runner.is_alive():
            state = _link_up(namespace, ifname)
            if state is not None and (not states or states[-1] != state):
                states.append(state)
            time.sleep(0.02)
    finally:
        runner.join(timeout=90)
    out = capsys.readouterr().out
    assert result == [0], out[-3000:]
    assert "[emulate] cut link of node 1 at step" in out
    assert "[emulate] restored link of node 1 at step" in out
    assert out.index("cut link of node 1") < out.index("restored link of node 1")
    while states and not states[0]:
        states.pop(0)  # seen while the network was being built
    assert states[:3] == [True, False, True], states  # up, cut, restored
    assert _leftovers(fault_run_id) == []
