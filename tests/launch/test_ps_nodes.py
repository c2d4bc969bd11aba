"""Parameter-server roles over several nodes, without starting anything: `longboat launch`'s
per-node counts and token rule, the job-wide layout, and `longboat emulate --server-nodes`."""

from __future__ import annotations

import argparse
import ipaddress
from pathlib import Path

import pytest

from longboat.launch import emulate, netns, options, ps_layout
from longboat.launch.options import LaunchOptionError


def _spec(tmp_path: Path, *argv: str) -> options.LaunchSpec:
    script = tmp_path / "train.py"
    script.write_text("")
    p = argparse.ArgumentParser()
    options.add_arguments(p)
    return options.spec_from_args(p.parse_args([*argv, str(script)]))


MULTI = ("--nnodes", "2", "--node-rank", "1", "--master", "10.0.0.1:29500")


def test_one_node_still_needs_servers_and_workers(tmp_path: Path) -> None:
    with pytest.raises(LaunchOptionError, match="needs both --servers N and --workers M"):
        _spec(tmp_path, "--servers", "1", "--workers", "0")


def test_checkpoint_dir_reaches_every_rank_of_a_ps_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from longboat.launch.runner import _rank_env

    monkeypatch.chdir(tmp_path)
    spec = _spec(tmp_path, "--servers", "2", "--workers", "2", "--checkpoint-dir", "pschk")
    assert spec.ps_checkpoint_dir == str(tmp_path / "pschk")
    env = _rank_env(spec, "127.0.0.1", [1, 2, 3, 4])
    assert env["LONGBOAT_PS_CHECKPOINT_DIR"] == str(tmp_path / "pschk")
    with pytest.raises(LaunchOptionError, match="--checkpoint-dir pschk is for parameter-server"):
        _spec(tmp_path, "--nproc-per-node", "2", "--checkpoint-dir", "pschk")


def test_several_nodes_need_a_shared_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LONGBOAT_PS_TOKEN", raising=False)
    monkeypatch.delenv("LONGBOAT_PS_TOKEN_FILE", raising=False)
    with pytest.raises(LaunchOptionError, match="same job token on every node.*token_urlsafe"):
        _spec(tmp_path, *MULTI, "--servers", "0", "--workers", "1")
    missing = tmp_path / "nope.token"
    monkeypatch.setenv("LONGBOAT_PS_TOKEN_FILE", str(missing))
    with pytest.raises(LaunchOptionError, match="LONGBOAT_PS_TOKEN_FILE"):
        _spec(tmp_path, *MULTI, "--servers", "0", "--workers", "1")
    monkeypatch.delenv("LONGBOAT_PS_TOKEN_FILE")
    monkeypatch.setenv("LONGBOAT_PS_TOKEN", "shared")
    trainer_node = _spec(tmp_path, *MULTI, "--servers", "0", "--workers", "1")
    assert trainer_node.multinode_ps and trainer_node.local_procs == 1
    server_node = _spec(tmp_path, *MULTI, "--servers", "2", "--workers", "0")
    assert server_node.local_procs == 2 and server_node.workers == 0


def test_layout_puts_every_server_first() -> None:
    # torch numbers node by node: node 0 = [server, trainer], node 1 = [trainer], node 2 = [server]
    entries = [["server", "a:1"], ["trainer", "a:2"], ["trainer", "b:1"], ["server", "c:1"]]
    layouts = [ps_layout.build(entries, r) for r in range(4)]
    assert layouts[0].endpoints == ["a:1", "c:1", "a:2", "b:1"]
    assert [(x.role, x.index, x.rank) for x in layouts] == [
        ("server", 0, 0), ("trainer", 0, 2), ("trainer", 1, 3), ("server", 1, 1),
    ]  # fmt: skip


def test_layout_without_a_server_or_a_trainer_is_refused() -> None:
    with pytest.raises(ps_layout.LayoutError, match="no server; give some node --servers"):
        ps_layout.build([["trainer", "a:1"], ["trainer", "b:1"]], 0)
    with pytest.raises(ps_layout.LayoutError, match="no trainer; give some node --workers"):
        ps_layout.build([["server", "a:1"]], 0)


def _plan(nodes: int) -> netns.Plan:
    net = ipaddress.ip_network("10.1.2.0/24")
    return netns.Plan(
        "abc123",
        "lbemabc123b",
        net,
        tuple(
            netns.Node(
                i, f"lbemabc123-node{i}", f"lbemabc123n{i}", f"lbemabc123h{i}", f"10.1.2.{i + 1}"
            )
            for i in range(nodes)
        ),
        10**9,
        125_000,
        None,
    )


def _emulate_args(**kw: object) -> argparse.Namespace:
    base = dict(nodes=4, nproc_per_node=1, master_port=29500, script="t.py", script_args=[])
    return argparse.Namespace(**(base | kw))


def test_emulate_server_nodes_run_only_servers() -> None:
    args = _emulate_args(server_nodes=2, servers=2, workers=4)
    assert emulate.ps_roles(args) == [(1, 0), (1, 0), (0, 2), (0, 2)]
    plan = _plan(4)
    server = emulate.launcher_command(plan, plan.nodes[1], args, Path("/logs"))
    trainer = emulate.launcher_command(plan, plan.nodes[3], args, Path("/logs"))
    assert "--servers 1 --workers 0" in " ".join(server)
    assert "--servers 0 --workers 2" in " ".join(trainer)
    assert "--nproc-per-node" not in server


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(server_nodes=2, servers=3, workers=2), "--servers 3 does not spread evenly over 2"),
        (dict(server_nodes=2, servers=2, workers=3), "--workers 3 does not spread evenly over 2"),
        (dict(server_nodes=4, servers=4, workers=4), "--server-nodes 4: give 1..3"),
        (dict(server_nodes=2, servers=2), "needs all of --server-nodes, --servers and --workers"),
    ],
)
def test_emulate_refuses_uneven_splits(kw: dict, message: str) -> None:
    with pytest.raises(emulate.EmulateError, match=message):
        emulate.ps_roles(_emulate_args(**kw))


def test_paddle_endpoint_lists_pick_this_nodes_entries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LONGBOAT_PS_TOKEN", "shared")
    monkeypatch.setattr(options, "_node_rank_from_ips", lambda ips: ips.index("10.0.0.3"))
    servers, workers = "10.0.0.1:6170,10.0.0.2:6170", "10.0.0.3:6171,10.0.0.3:6172,10.0.0.4:6171"
    spec = _spec(tmp_path, "--servers", servers, "--workers", workers, "--master", ":29500")
    assert spec.ips == ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"] and spec.nnodes == 4
    assert (spec.node_rank, spec.servers, spec.workers) == (2, 0, 2)
    assert spec.ports == [6171, 6172] and spec.master_host == "10.0.0.1"


def test_paddle_endpoint_lists_on_one_machine(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "--servers", "127.0.0.1:6170", "--workers", "127.0.0.1:6171")
    assert (spec.nnodes, spec.servers, spec.workers, spec.ports) == (1, 1, 1, [6170, 6171])


@pytest.mark.parametrize(
    ("servers", "workers", "message"),
    [
        ("10.0.0.1:1,10.0.0.2:1,10.0.0.1:2", "10.0.0.3:1", "list each node's endpoints together"),
        ("10.0.0.1:1", "10.0.0.1:1", "10.0.0.1:1 is listed twice"),
        ("10.0.0.1:1", "2", "both as counts or both as ip:port lists"),
    ],
)
def test_paddle_endpoint_lists_are_checked(
    tmp_path: Path, servers: str, workers: str, message: str
) -> None:
    with pytest.raises(LaunchOptionError, match=message):
        _spec(tmp_path, "--servers", servers, "--workers", workers, "--master", ":29500")


def test_a_conflicting_config_stops_the_launch_and_ps_jobs_check_it_in_ps_mode(
    tmp_path: Path,
) -> None:
    conflict = tmp_path / "conflict.yaml"
    conflict.write_text("localsgd: true\ngradient_compression: fp16\n")
    with pytest.raises(LaunchOptionError, match="localsgd.*gradient_compression"):
        _spec(tmp_path, "--nproc-per-node", "1", "--config", str(conflict))
    # Paddle's parameter-server setup sets a_sync_configs without saying mode: ps
    geo = tmp_path / "geo.yaml"
    geo.write_text("a_sync: true\na_sync_configs:\n  k_steps: 4\n")
    with pytest.raises(LaunchOptionError, match="a_sync_configs"):
        _spec(tmp_path, "--nproc-per-node", "1", "--config", str(geo))
    spec = _spec(tmp_path, "--servers", "1", "--workers", "1", "--config", str(geo))
    assert spec.servers == 1
