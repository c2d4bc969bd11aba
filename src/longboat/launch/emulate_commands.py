"""What each emulated node runs: its `longboat launch` (or torchrun) command line, its
parameter-server roles and its environment."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from longboat.launch.netns import Node, Plan

#: ``--launcher torchrun`` in elastic runs: restarts torchrun may spend on lost nodes.
TORCHRUN_MAX_RESTARTS = 3


class EmulateError(RuntimeError):
    """A precondition failed (rights, tools, arguments); nothing was created."""


def launcher_command(
    plan: Plan,
    node: Node,
    args: argparse.Namespace,
    log_dir: Path,
    master: str | None = None,
) -> list[str]:
    """The command each node runs inside its namespace: `longboat launch` for that node.

    Static runs: ``--nnodes N --node-rank i``, master on node 0. Elastic runs (the plan has a
    bridge address): ``--nnodes MIN:MAX`` with MAX = every planned node, spares included, and
    the rendezvous on the bridge; the rendezvous numbers the nodes.
    """
    master = master or _default_master(plan, args)
    if getattr(args, "launcher", "longboat") == "torchrun":
        return torchrun_command(plan, node, args, master)
    return [
        sys.executable,
        "-m",
        "longboat",
        "launch",
        "--nnodes",
        *_node_count(plan, node, args),
        *_procs(args, node),
        *(["--max-restarts", str(args.max_restarts)] if getattr(args, "max_restarts", 0) else []),
        "--master",
        master,
        "--log-dir",
        str(log_dir / f"node{node.index}"),
        args.script,
        *_script_args(args.script_args),
    ]


def ps_roles(args: argparse.Namespace) -> list[tuple[int, int]] | None:
    """``(servers, workers)`` of each node of a parameter-server run, None otherwise."""
    given = [getattr(args, k, None) for k in ("server_nodes", "servers", "workers")]
    if all(v is None for v in given):
        return None
    if any(v is None for v in given):
        raise EmulateError(
            "a parameter-server run needs all of --server-nodes, --servers and --workers"
        )
    k, servers, workers = given
    trainer_nodes = args.nodes - k
    if not 1 <= k < args.nodes:
        raise EmulateError(
            f"--server-nodes {k}: give 1..{args.nodes - 1}, so that at least one of the "
            f"--nodes {args.nodes} nodes runs trainers"
        )
    for flag, count, nodes in (("--servers", servers, k), ("--workers", workers, trainer_nodes)):
        if count < nodes or count % nodes:
            raise EmulateError(
                f"{flag} {count} does not spread evenly over {nodes} node(s): give a multiple "
                f"of {nodes} (at least one per node)"
            )
    return [(servers // k, 0)] * k + [(0, workers // trainer_nodes)] * trainer_nodes


def _procs(args: argparse.Namespace, node: Node) -> list[str]:
    """``--nproc-per-node P``, or a parameter-server node's ``--servers s --workers w``."""
    roles = ps_roles(args)
    if roles is None:
        return ["--nproc-per-node", str(args.nproc_per_node)]
    servers, workers = roles[node.index]
    return ["--servers", str(servers), "--workers", str(workers)]


def _default_master(plan: Plan, args: argparse.Namespace) -> str:
    host = plan.bridge_address or plan.nodes[0].address
    return f"{host}:{args.master_port}"


def _node_count(plan: Plan, node: Node, args: argparse.Namespace) -> list[str]:
    """``N --node-rank i`` (static) or ``MIN:MAX`` (elastic), following ``--nnodes``."""
    if plan.bridge_address is None:
        return [str(len(plan.nodes)), "--node-rank", str(node.index)]
    return [f"{getattr(args, 'min_nodes', None) or 1}:{len(plan.nodes)}"]


#: torchrun's quickest c10d settings (whole seconds): a node silent for 3 x 1 s is lost, a
#: round waits 1 s of last call.
TORCHRUN_RDZV_CONF = {
    "join_timeout": 300,
    "last_call_timeout": 1,
    "keep_alive_interval": 1,
    "keep_alive_max_attempt": 3,
    "close_timeout": 10,
}


def torchrun_command(plan: Plan, node: Node, args: argparse.Namespace, master: str) -> list[str]:
    """The same node started by plain torchrun (``--launcher torchrun``), for comparison."""
    host, port = master.rsplit(":", 1)
    if plan.bridge_address is not None:  # elastic: torchrun's own restarts
        conf = ",".join(f"{k}={v}" for k, v in TORCHRUN_RDZV_CONF.items())
        rendezvous = [
            *("--rdzv-backend", "c10d", "--rdzv-endpoint", master, "--rdzv-id", plan.prefix),
            *("--rdzv-conf", conf, "--max-restarts", str(TORCHRUN_MAX_RESTARTS)),
            *("--local-addr", node.address),  # else the ranks meet on "localhost"
        ]
    else:
        rendezvous = ["--master-addr", host, "--master-port", port]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        *_node_count(plan, node, args),
        "--nproc-per-node",
        str(args.nproc_per_node),
        *rendezvous,
        args.script,
        *_script_args(args.script_args),
    ]


def _script_args(extra: Sequence[str]) -> list[str]:
    return list(extra[1:]) if extra and extra[0] == "--" else list(extra)


def node_env(plan: Plan, node: Node) -> dict[str, str]:
    """The launcher's environment: ours plus the node's identity and its link.

    Elastic runs leave the node rank and count to the rendezvous.
    """
    env = dict(os.environ)
    env.update(
        GLOO_SOCKET_IFNAME=node.ifname,
        LONGBOAT_EMULATE_BANDWIDTH=plan.rate,
        PYTHONUNBUFFERED="1",
    )
    if plan.bridge_address is None:
        env.update(LONGBOAT_NODE_RANK=str(node.index), LONGBOAT_NNODES=str(len(plan.nodes)))
    else:
        env.pop("LONGBOAT_NODE_RANK", None)
        env.pop("LONGBOAT_NNODES", None)
    if plan.latency_s:
        env["LONGBOAT_EMULATE_LATENCY"] = f"{plan.latency_s * 1e3:g}ms"
    return env
