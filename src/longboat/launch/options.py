"""`longboat launch` options and their validation into a LaunchSpec."""

from __future__ import annotations

import argparse
import copy
import os
from dataclasses import dataclass, field

from longboat.cluster.env import check_variables
from longboat.cluster.info import ClusterError
from longboat.launch.gpu_layout import gpu_layout_problem
from longboat.launch.ps_endpoints import NodeRoles, count_or_endpoints, node_roles


@dataclass(frozen=True)
class LaunchSpec:
    """Everything the launcher needs, validated."""

    target: str  # a script path, or a module name with module=True
    target_args: list[str]
    module: bool = False
    nproc_per_node: int = 1
    devices: list[str] = field(default_factory=list)
    nnodes: int = 1  # elastic: the most nodes (MAX of --nnodes MIN:MAX)
    node_rank: int = 0  # elastic: unknown before the rendezvous (0)
    min_nodes: int | None = None  # elastic jobs only (--nnodes MIN:MAX)
    failure_timeout: float | None = None
    master_host: str | None = None
    master_port: int | None = None
    ips: list[str] = field(default_factory=list)
    log_dir: str = "log"
    max_restarts: int = 0
    config: str | None = None
    tee_all: bool = False
    servers: int = 0
    workers: int = 0
    ports: list[int] = field(default_factory=list)  # this node's ranks' ports, when listed
    timeout: float = 300.0
    ps_checkpoint_dir: str | None = None  # parameter-server checkpoints (absolute path)

    @property
    def ps(self) -> bool:
        """Parameter-server mode: ``--servers``/``--workers`` given for this node."""
        return bool(self.servers or self.workers)

    @property
    def multinode_ps(self) -> bool:
        """Parameter-server roles spread over several nodes (job-wide layout gathered at start)."""
        return self.ps and self.nnodes > 1

    @property
    def local_procs(self) -> int:
        """Processes this node starts (PS: this node's servers + workers)."""
        return self.servers + self.workers if self.ps else self.nproc_per_node

    @property
    def elastic(self) -> bool:
        """``--nnodes MIN:MAX``: ranks survive nodes leaving and joining."""
        return self.min_nodes is not None

    @property
    def world_size(self) -> int:
        return self.local_procs * self.nnodes


class LaunchOptionError(ValueError):
    """A launch option is wrong; the message names it and the fix."""


class _DashHelpFormatter(argparse.HelpFormatter):
    """Help shows the dash spelling of an option; its underscore twin is accepted unlisted."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        names = action.option_strings
        shown = [n for n in names if not ("_" in n and n.replace("_", "-") in names)]
        if shown != names:
            action = copy.copy(action)
            action.option_strings = shown
        return super()._format_action_invocation(action)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `longboat launch` (and `python -m longboat.launch`)."""
    p.formatter_class = _DashHelpFormatter
    procs = p.add_argument_group("processes")
    procs.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        type=int,
        default=None,
        help="ranks on this node (default: number of --gpus, else 1)",
    )
    procs.add_argument(
        "--gpus",
        "--devices",
        dest="devices",
        default=None,
        help="comma list of device ids, one rank per device (pins each rank)",
    )
    procs.add_argument(
        "-np",
        "--num-proc",
        "--num_proc",
        dest="num_proc",
        type=int,
        default=None,
        help="horovodrun's -np: total ranks (one host: --nproc-per-node; see -H)",
    )
    procs.add_argument(
        "-H",
        "--hosts",
        dest="hosts",
        default=None,
        help="horovodrun's host list h1:slots,h2:slots (several hosts: --ips and equal slots; "
        "run the same command on every host)",
    )
    procs.add_argument(
        "--servers",
        "--server-num",
        "--server_num",
        type=count_or_endpoints,
        default=0,
        help="parameter-server mode: server processes on this node (0 on a trainer-only node "
        "of a multi-node job), or every server's ip:port (Paddle style: the same list on "
        "every node; each node runs the entries with its own ip)",
    )
    procs.add_argument(
        "--workers",
        "--worker-num",
        "--worker_num",
        type=count_or_endpoints,
        default=0,
        help="parameter-server mode: trainer processes on this node (0 on a server-only node "
        "of a multi-node job), or every trainer's ip:port (with --servers ip:port,...)",
    )
    procs.add_argument(
        "--checkpoint-dir",
        default=None,
        metavar="DIR",
        help="parameter-server mode: where servers write checkpoints (lb.ps.save(), "
        "LONGBOAT_PS_CHECKPOINT_EVERY) and restart from; sets LONGBOAT_PS_CHECKPOINT_DIR "
        "for every rank",
    )
    cluster = p.add_argument_group("cluster")
    cluster.add_argument(
        "--standalone",
        action="store_true",
        help="torchrun's one-node mode: 127.0.0.1 and a free port (the default on one node; "
        "MASTER_ADDR/MASTER_PORT in the environment are then ignored)",
    )
    cluster.add_argument(
        "--nnodes",
        type=_nnodes,
        default=None,
        metavar="N|MIN:MAX",
        help="number of nodes (default 1); MIN:MAX runs an elastic job that goes on while at "
        "least MIN nodes are alive and admits nodes that join, up to MAX (see docs/elastic.md)",
    )
    cluster.add_argument(
        "--node-rank",
        "--node_rank",
        type=int,
        default=None,
        help="this node's index (default 0, or its position in --ips)",
    )
    cluster.add_argument(
        "--master",
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        default=None,
        metavar="HOST:PORT",
        help="rendezvous endpoint on node 0 (default: MASTER_ADDR and MASTER_PORT from the "
        "environment, else 127.0.0.1 and a free port)",
    )
    cluster.add_argument(
        "--master-addr",
        "--master_addr",
        default=None,
        metavar="HOST",
        help="torchrun's spelling of the HOST of --master",
    )
    cluster.add_argument(
        "--master-port",
        "--master_port",
        type=_port,
        default=None,
        metavar="PORT",
        help="torchrun's spelling of the PORT of --master",
    )
    cluster.add_argument(
        "--ips",
        default=None,
        help="Paddle-style comma list of node addresses; the first is the master",
    )
    run = p.add_argument_group("run")
    run.add_argument("--log-dir", "--log_dir", default="log", help="per-rank logs (default log/)")
    run.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=int,
        default=0,
        help="restart the whole group up to this many times after a failure (each restart is "
        "reported on the console)",
    )
    run.add_argument(
        "--failure-timeout",
        "--failure_timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long a collective waits for a silent peer before it counts as lost "
        "(exported as LONGBOAT_TIMEOUT; default 300, elastic jobs 30)",
    )
    run.add_argument("--config", default=None, help="a Strategy YAML/JSON file exported to ranks")
    run.add_argument(
        "--tee",
        choices=["0", "all"],
        default="0",
        help="ranks shown on this console: 0 (trainer 0, the default) or all",
    )
    run.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds to wait for rendezvous and for servers to accept (default 300)",
    )
    p.add_argument("-m", "--module", action="store_true", help="run TARGET as a module")
    p.add_argument("target", metavar="TARGET", help="the training script (or module with -m)")
    p.add_argument("target_args", nargs=argparse.REMAINDER, help="arguments for the script")


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
        from longboat.ps.auth import AuthError, load_token

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


def _master(master: str | None, ips: list[str]) -> tuple[str | None, int | None]:
    if master is None:
        return (ips[0] if ips else None), None
    host, sep, port_text = master.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise LaunchOptionError(f"--master {master!r}: expected HOST:PORT with a port in 1..65535")
    return (host or (ips[0] if ips else None)), int(port_text)


def _port(text: str) -> int:
    """An argparse type: a TCP port in 1..65535."""
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"expected a port in 1..65535, got {text!r}")
    return int(text)


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


def _nnodes(text: str) -> tuple[int | None, int]:
    """``N`` -> (None, N); ``MIN:MAX`` -> (MIN, MAX), an elastic job."""
    low, colon, high = text.partition(":")
    try:
        values = (int(low), int(high)) if colon else (None, int(low))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a node count: give N, or MIN:MAX for an elastic job (e.g. 2:4)"
        ) from None
    first, most = values
    if most < 1 or (first is not None and not 1 <= first <= most):
        raise argparse.ArgumentTypeError(
            f"{text!r}: node counts must be >= 1 and MIN <= MAX (e.g. 2:4)"
        )
    return first, most


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
