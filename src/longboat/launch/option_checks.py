"""The checks behind `longboat launch`'s options: hosts and slots, the rendezvous endpoint,
parameter-server roles and their token, devices, log directory, config file, environment and
Strategy; each raises `LaunchOptionError` naming the option and the fix."""

from __future__ import annotations

import argparse
import os

from longboat.cluster.env import check_variables
from longboat.cluster.info import ClusterError
from longboat.launch.option_args import _port
from longboat.launch.ps_endpoints import NodeRoles, node_roles
from longboat.launch.spec import LaunchOptionError

_LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")

TOKEN_HOWTO = (
    "create one and give it to every node, e.g. `python -c 'import secrets; "
    "print(secrets.token_urlsafe(32))' > ps.token && chmod 600 ps.token` on a filesystem every "
    "node reads, then LONGBOAT_PS_TOKEN_FILE=$PWD/ps.token (or export LONGBOAT_PS_TOKEN=...)"
)


def _endpoint_lists(a: argparse.Namespace) -> NodeRoles | None:
    """Paddle's ``--servers ip:port,... --workers ip:port,...``: the lists by node (their nodes
    become ``--ips``); None when counts were given."""
    lists = [isinstance(v, list) for v in (a.servers, a.workers)]
    if not any(lists):
        return None
    if not all(lists):
        raise LaunchOptionError(
            "give --servers and --workers both as counts or both as ip:port lists"
        )
    if a.ips or a.nnodes or a.node_rank is not None or a.num_proc or a.hosts:
        raise LaunchOptionError(
            "--servers/--workers ip:port lists name the nodes: drop --ips/--nnodes/--node-rank"
        )
    servers, workers = a.servers, a.workers
    if all(h in _LOCAL_HOSTS for h, _ in servers + workers):  # one machine: every entry is ours
        servers = [("127.0.0.1", port) for _, port in servers]
        workers = [("127.0.0.1", port) for _, port in workers]
    try:
        roles = node_roles(servers, workers)
    except ValueError as exc:
        raise LaunchOptionError(str(exc)) from None
    a.ips = None if roles.nodes == ["127.0.0.1"] else ",".join(roles.nodes)
    return roles


def _check_ps_roles(servers: int, workers: int, nnodes: int) -> None:
    """``--servers``/``--workers``: counts on this node; one node needs both, several nodes
    need a job token every node shares (the job-wide counts are checked at start-up), and a
    token file given must be one the servers accept."""
    if servers < 0 or workers < 0:
        raise LaunchOptionError(f"--servers {servers} --workers {workers}: counts must be >= 0")
    if not (servers or workers):
        return
    if nnodes == 1 and not (servers and workers):
        raise LaunchOptionError(
            "parameter-server mode needs both --servers N and --workers M (>= 1) on one node; "
            "on several nodes (--nnodes) a node may run only servers or only trainers"
        )
    if nnodes > 1 and not (
        os.environ.get("LONGBOAT_PS_TOKEN") or os.environ.get("LONGBOAT_PS_TOKEN_FILE")
    ):
        raise LaunchOptionError(
            "parameter-server mode on several nodes needs the same job token on every node: "
            "set LONGBOAT_PS_TOKEN or LONGBOAT_PS_TOKEN_FILE before `longboat launch`; "
            + TOKEN_HOWTO
        )
    path = os.environ.get("LONGBOAT_PS_TOKEN_FILE")
    if path and not os.environ.get("LONGBOAT_PS_TOKEN"):
        from longboat.ps.shared.auth import AuthError, load_token

        try:
            load_token({"LONGBOAT_PS_TOKEN_FILE": path})
        except (AuthError, OSError) as exc:
            raise LaunchOptionError(f"LONGBOAT_PS_TOKEN_FILE: {exc}") from None


def _horovodrun_hosts(
    num_proc: int | None, hosts: str | None, nproc_per_node: int | None
) -> tuple[int, list[str]]:
    """horovodrun's ``-np N -H h1:s1,h2:s2``: ranks per node, and the node list when the
    hosts are not just this machine. Every host runs the same number of ranks."""
    slots = _host_slots(hosts)
    total = sum(n for _, n in slots) if slots else num_proc or 1
    np_ = total if num_proc is None else num_proc
    if np_ < 1 or np_ > total:
        raise LaunchOptionError(f"-np {np_} must be between 1 and the {total} slots of -H {hosts}")
    if nproc_per_node is not None and len(slots) <= 1 and nproc_per_node != np_:
        raise LaunchOptionError(
            f"-np {np_} disagrees with --nproc-per-node {nproc_per_node}; give one of them"
        )
    if len(slots) <= 1 or all(h in _LOCAL_HOSTS for h, _ in slots):
        return np_, []
    return _equal_slots(np_, total, slots, hosts), [h for h, _ in slots]


def _host_slots(hosts: str | None) -> list[tuple[str, int]]:
    """``-H h1:s1,h2:s2`` as (host, slots) pairs (a host without slots has 1)."""
    slots: list[tuple[str, int]] = []
    for item in (hosts or "").split(","):
        host, _, count = item.strip().partition(":")
        if not host:
            continue
        if count and not count.isdigit():
            raise LaunchOptionError(f"-H {hosts!r}: expected host:slots, e.g. localhost:2")
        slots.append((host, int(count or 1)))
    if hosts is not None and not slots:
        raise LaunchOptionError(f"-H {hosts!r}: expected host:slots, e.g. localhost:2")
    return slots


def _equal_slots(np_: int, total: int, slots: list[tuple[str, int]], hosts: str | None) -> int:
    """The ranks of each of several hosts: they must all have the same slots, all used."""
    counts = {n for _, n in slots}
    if len(counts) > 1 or np_ != total:
        raise LaunchOptionError(
            f"-np {np_} -H {hosts}: longboat runs the same number of ranks on every host; use "
            "equal slots and -np equal to their sum"
        )
    return counts.pop()


def _master(master: str | None, ips: list[str]) -> tuple[str | None, int | None]:
    if master is None:
        return (ips[0] if ips else None), None
    host, sep, port_text = master.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise LaunchOptionError(f"--master {master!r}: expected HOST:PORT with a port in 1..65535")
    return (host or (ips[0] if ips else None)), int(port_text)


def _endpoint(a: argparse.Namespace, ips: list[str]) -> tuple[str | None, int | None]:
    """The rendezvous host and port: from --master (alias --rdzv-endpoint), else from
    --master-addr/--master-port, else from MASTER_ADDR/MASTER_PORT (not with --standalone)."""
    if a.master is not None and (a.master_addr is not None or a.master_port is not None):
        raise LaunchOptionError(
            "give the rendezvous endpoint once: --master HOST:PORT, or --master-addr and "
            "--master-port"
        )
    host, port = _master(a.master, ips)
    if a.master is None:
        host = a.master_addr or host
        port = a.master_port
    if a.standalone:
        return host, port
    if host is None:
        host = os.environ.get("MASTER_ADDR", "").strip() or None
    if port is None and os.environ.get("MASTER_PORT", "").strip():
        text = os.environ["MASTER_PORT"].strip()
        try:
            port = _port(text)
        except argparse.ArgumentTypeError:
            raise LaunchOptionError(
                f"MASTER_PORT={text!r} in the environment is not a port in 1..65535; "
                "fix or unset it, or pass --master-port"
            ) from None
    return host, port


def _check_devices(devices: list[str], given: str | None) -> None:
    """``--gpus`` must name GPUs this machine has: a silent CPU run is not what was asked."""
    if not devices:
        return
    if len(set(devices)) != len(devices):
        raise LaunchOptionError(f"--gpus {given} lists a device twice; give each device once")
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        raise LaunchOptionError(
            f"--gpus {given}: torch sees no CUDA GPU on this machine (torch {torch.__version__}"
            f"{', a CPU-only build' if torch.version.cuda is None else ''}); leave --gpus out "
            "and give --nproc-per-node N to run on the CPU, or run `longboat doctor`"
        )
    missing = [d for d in devices if d.isdigit() and int(d) >= count]
    if missing:
        raise LaunchOptionError(
            f"--gpus {given}: no device {', '.join(missing)} here; this machine has {count} "
            f"GPU{'s' if count != 1 else ''} (ids 0-{count - 1})"
        )


def _check_log_dir(log_dir: str) -> None:
    """``--log-dir`` must be a directory, or a path where one can be made."""
    path = os.path.abspath(log_dir)
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if os.path.isdir(existing):
        return
    what = "is a file" if existing == path else f"is inside {existing}, which is a file"
    raise LaunchOptionError(
        f"--log-dir {log_dir} {what}, not a directory; give a directory (made if missing)"
    )


def _check_config_file(path: str, given: str) -> None:
    """``--config`` must exist and set something: an empty file would train with the defaults
    without a word."""
    if not os.path.isfile(path):
        raise LaunchOptionError(f"--config {given}: no such file")
    with open(path, encoding="utf-8", errors="replace") as f:
        content = [line.strip() for line in f]
    if all(not line or line.startswith("#") or line in ("---", "...") for line in content):
        raise LaunchOptionError(
            f"--config {given} is empty (no Strategy fields); give the fields to set, or drop "
            "--config to train with the defaults"
        )


def _replaced(a: argparse.Namespace) -> frozenset[str]:
    """The ``LONGBOAT_*`` variables these options replace for the ranks."""
    names = {
        "LONGBOAT_TIMEOUT": a.failure_timeout,
        "LONGBOAT_CONFIG": a.config,
        "LONGBOAT_PS_CHECKPOINT_DIR": a.checkpoint_dir,
    }
    return frozenset(name for name, option in names.items() if option is not None)


def _check_environment(replaced_by_options: frozenset[str]) -> None:
    """Every ``LONGBOAT_*`` variable of the launcher's environment the ranks would read,
    parsed as they parse it (`longboat.cluster.env.VARIABLES`)."""
    try:
        check_variables(skip=replaced_by_options)
    except ClusterError as exc:
        raise LaunchOptionError(str(exc)) from None


def _check_strategy(config: str | None, ps: bool) -> None:
    """Run the ranks' Strategy checks here (values, then the conflicts checked when a strategy
    is used), so a typo or a conflict stops the launch before any rank starts. ``ps``: the
    job runs parameter servers, so its ranks use the strategy in mode 'ps'."""
    from longboat.strategy import Strategy, StrategyError
    from longboat.strategy.changes import check_use

    try:
        strategy = Strategy.load(config) if config else Strategy()
        if ps:
            strategy.mode = "ps"
        check_use(strategy.to_dict())
    except StrategyError as exc:
        raise LaunchOptionError(_one_line(str(exc))) from None


def _one_line(message: str) -> str:
    """``message`` on one line, without the source excerpts YAML errors quote."""
    lines = [line.strip() for line in message.splitlines()]
    kept = [
        line.rstrip(":")
        for i, line in enumerate(lines)
        if line
        and set(line) != {"^"}
        and not (i + 1 < len(lines) and lines[i + 1] and set(lines[i + 1]) == {"^"})
    ]
    return "; ".join(kept)


def _check_elastic(a: argparse.Namespace, min_nodes: int, max_nodes: int) -> None:
    """What an elastic job needs: a rendezvous endpoint, no fixed node ranks, no PS roles."""
    if a.node_rank is not None or a.ips:
        raise LaunchOptionError(
            f"--nnodes {min_nodes}:{max_nodes} is elastic: the rendezvous numbers the nodes, "
            "so drop --node-rank/--ips"
        )
    if a.servers or a.workers:
        raise LaunchOptionError(
            "parameter-server roles are not elastic: drop --nnodes MIN:MAX or --servers"
        )
    if a.standalone:
        raise LaunchOptionError("--standalone is one fixed node: drop it or --nnodes MIN:MAX")
