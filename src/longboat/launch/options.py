"""`longboat launch` options and their validation into a LaunchSpec: the argparse definition
lives in `longboat.launch.option_args`, the checks in `longboat.launch.option_checks`; here
`spec_from_args` runs them in order."""

from __future__ import annotations

import argparse
import os

from longboat.launch.gpu_layout import gpu_layout_problem
from longboat.launch.option_args import add_arguments
from longboat.launch.option_checks import (
    TOKEN_HOWTO,
    _check_config_file,
    _check_devices,
    _check_elastic,
    _check_environment,
    _check_log_dir,
    _check_ps_roles,
    _check_strategy,
    _endpoint,
    _endpoint_lists,
    _horovodrun_hosts,
    _replaced,
)
from longboat.launch.ps_endpoints import NodeRoles
from longboat.launch.spec import LaunchOptionError, LaunchSpec

__all__ = ["TOKEN_HOWTO", "LaunchOptionError", "LaunchSpec", "add_arguments", "spec_from_args"]


def spec_from_args(a: argparse.Namespace) -> LaunchSpec:
    """Validate the parsed options; every error names the option and the fix. The option
    groups are checked in a fixed order (the first error found is the one reported)."""
    devices = _devices(a)
    nproc = _ranks_per_node(a, devices)
    listed = _endpoint_lists(a)
    ips, min_nodes, nnodes = _node_count(a)
    node_rank = a.node_rank if a.node_rank is not None else _node_rank_from_ips(ips)
    _check_failure_timeout(a.failure_timeout)
    _check_node_rank(node_rank, nnodes)
    host, port = _rendezvous(a, ips, nnodes)
    fixed_ports = _ps_roles(a, listed, ips, node_rank, nnodes)
    config = _run_options(a)
    _check_target(a.target, a.module)
    if not (devices or a.servers or a.workers):  # --gpus lists its devices (checked above)
        _check_gpu_layout(nproc)
    return LaunchSpec(
        target=a.target,
        target_args=_target_args(a.target_args),
        module=a.module,
        nproc_per_node=nproc,
        devices=devices,
        nnodes=nnodes,
        node_rank=node_rank,
        min_nodes=min_nodes,
        failure_timeout=a.failure_timeout,
        master_host=host,
        master_port=port,
        ips=ips,
        log_dir=a.log_dir,
        max_restarts=a.max_restarts,
        config=config,
        tee_all=a.tee == "all",
        servers=a.servers,
        workers=a.workers,
        ports=fixed_ports,
        timeout=a.timeout,
        ps_checkpoint_dir=_ps_checkpoint_dir(a),
    )


def _ps_checkpoint_dir(a: argparse.Namespace) -> str | None:
    """``--checkpoint-dir``: parameter-server mode only; its absolute path."""
    if a.checkpoint_dir is None:
        return None
    if not (a.servers or a.workers):
        raise LaunchOptionError(
            f"--checkpoint-dir {a.checkpoint_dir} is for parameter-server jobs (with --servers "
            "and --workers); collective jobs save with lb.save_checkpoint(path, ...)"
        )
    return os.path.abspath(a.checkpoint_dir)


def _devices(a: argparse.Namespace) -> list[str]:
    """``--gpus``: the devices listed (checked against this machine and --nproc-per-node)."""
    devices = [d.strip() for d in a.devices.split(",") if d.strip()] if a.devices else []
    if a.nproc_per_node is not None and devices and a.nproc_per_node != len(devices):
        raise LaunchOptionError(
            f"--nproc-per-node {a.nproc_per_node} disagrees with --gpus {a.devices} "
            f"({len(devices)} devices); give one of them"
        )
    if a.nproc_per_node is not None and a.nproc_per_node < 1:
        raise LaunchOptionError(
            f"--nproc-per-node must be >= 1, got {a.nproc_per_node}; give the number of ranks "
            "to start on this node, or leave it out for one per --gpus device (else 1)"
        )
    _check_devices(devices, a.devices)
    return devices


def _ranks_per_node(a: argparse.Namespace, devices: list[str]) -> int:
    """Ranks on this node: --nproc-per-node, one per --gpus device, or horovodrun's -np/-H
    (whose hosts become ``a.ips``)."""
    nproc = a.nproc_per_node or len(devices) or 1
    if a.num_proc is not None or a.hosts is not None:
        nproc, host_ips = _horovodrun_hosts(a.num_proc, a.hosts, a.nproc_per_node)
        if host_ips and a.ips:
            raise LaunchOptionError("give the hosts once: -H or --ips, not both")
        a.ips = a.ips or ",".join(host_ips) or None
    if nproc < 1:
        raise LaunchOptionError(f"--nproc-per-node must be >= 1, got {nproc}")
    return nproc


def _node_count(a: argparse.Namespace) -> tuple[list[str], int | None, int]:
    """``--ips`` and ``--nnodes``: the node addresses, the elastic minimum (None: a fixed
    job) and the (most) nodes."""
    ips = [h.strip() for h in a.ips.split(",") if h.strip()] if a.ips else []
    min_nodes, nnodes = a.nnodes if a.nnodes else (None, max(1, len(ips)))
    if min_nodes is not None:
        _check_elastic(a, min_nodes, nnodes)
    if ips and len(ips) != nnodes:
        raise LaunchOptionError(f"--ips lists {len(ips)} nodes but --nnodes is {nnodes}")
    return ips, min_nodes, nnodes


def _check_failure_timeout(seconds: float | None) -> None:
    if seconds is not None and not seconds > 0:
        raise LaunchOptionError(
            f"--failure-timeout must be a positive number of seconds, got {seconds}"
        )


def _check_node_rank(node_rank: int, nnodes: int) -> None:
    if not 0 <= node_rank < nnodes:
        raise LaunchOptionError(
            f"--node-rank {node_rank} is outside 0..{nnodes - 1} (--nnodes {nnodes})"
        )


def _rendezvous(
    a: argparse.Namespace, ips: list[str], nnodes: int
) -> tuple[str | None, int | None]:
    """The rendezvous host and port (``_endpoint``); several nodes need both, and
    ``--standalone`` only one node."""
    if a.standalone and (nnodes > 1 or a.master or a.master_addr or a.master_port):
        raise LaunchOptionError(
            "--standalone runs one node on 127.0.0.1 and a free port; drop --standalone, or "
            "drop --nnodes/--ips/--master/--master-addr/--master-port"
        )
    host, port = _endpoint(a, ips)
    if nnodes > 1 and host is None:
        raise LaunchOptionError(
            f"--nnodes {nnodes} needs the rendezvous endpoint on node 0: --master HOST:PORT "
            "(or --master-addr and --master-port, or --ips h0,h1,... with --master :PORT)"
        )
    if nnodes > 1 and port is None:
        raise LaunchOptionError("multi-node launch needs an explicit port: --master HOST:PORT")
    return host, port


def _ps_roles(
    a: argparse.Namespace,
    listed: NodeRoles | None,
    ips: list[str],
    node_rank: int,
    nnodes: int,
) -> list[int]:
    """This node's parameter-server roles: with ip:port lists, its entries become
    ``a.servers``/``a.workers`` and their ports are returned ([] for counts)."""
    fixed_ports: list[int] = []
    if listed is not None:  # this node's entries of the lists
        mine = ips[node_rank] if ips else "127.0.0.1"
        a.servers, a.workers = listed.count(mine)
        fixed_ports = listed.ports(mine)
    _check_ps_roles(a.servers, a.workers, nnodes)
    return fixed_ports


def _run_options(a: argparse.Namespace) -> str | None:
    """``--max-restarts``, ``--log-dir``, ``--config`` (its absolute path, returned), the
    ``LONGBOAT_*`` environment and the Strategy the ranks will use."""
    if a.max_restarts < 0:
        raise LaunchOptionError(f"--max-restarts must be >= 0, got {a.max_restarts}")
    _check_log_dir(a.log_dir)
    config = os.path.abspath(a.config) if a.config else None
    if config:
        _check_config_file(config, a.config)
    _check_environment(replaced_by_options=_replaced(a))
    _check_strategy(config, ps=bool(a.servers))
    return config


def _check_target(target: str, module: bool) -> None:
    if not module and not os.path.isfile(target):
        raise LaunchOptionError(f"{target}: no such script (use -m to run a module)")


def _check_gpu_layout(nproc: int) -> None:
    """``nproc`` ranks without --gpus: refused where this machine's GPUs do not fit them."""
    problem = gpu_layout_problem(nproc)
    if problem:
        raise LaunchOptionError(problem)


def _target_args(args: list[str]) -> list[str]:
    """The script's arguments, without a leading ``--``."""
    args = list(args)
    if args[:1] == ["--"]:
        args = args[1:]
    return args


def _node_rank_from_ips(ips: list[str]) -> int:
    if not ips:
        return 0
    from longboat.launch.ports import local_ip_towards

    mine = {local_ip_towards(ip) for ip in ips} | {"127.0.0.1"}
    for i, ip in enumerate(ips):
        if ip in mine:
            return i
    raise LaunchOptionError(
        f"none of --ips {','.join(ips)} is an address of this machine; pass --node-rank"
    )
