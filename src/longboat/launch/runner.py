"""`longboat launch`: start ranks through torch's elastic agent and report what happened."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from torch.distributed import DistError
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousTimeoutError,
)
from torch.distributed.launcher.api import LaunchConfig

from longboat.cluster.env import VARIABLES, variable
from longboat.elastic.node_copy import ENV_COPY_DIR
from longboat.launch import options, rendezvous, torch_compat
from longboat.launch.agent import patched_environ, quiet_torch_logging, signals_raise_in_main_thread
from longboat.launch.arrivals import REPORT_EVERY_S, RendezvousWait, gave_up_line
from longboat.launch.banner import print_banner, print_job_servers_later
from longboat.launch.elastic_agent import ElasticAgent, MembershipChange, elastic_directory
from longboat.launch.elastic_files import elastic_files
from longboat.launch.log_lock import LogDirBusyError, claim_log_dir
from longboat.launch.logs import WorkerLogs, log_name
from longboat.launch.ports import free_port, holder_of, is_free, local_ip_towards, master_note
from longboat.launch.roles import role_of
from longboat.launch.spec import LaunchOptionError, LaunchSpec
from longboat.launch.summary import failure_summary, membership_line, restart_line
from longboat.launch.supervisor import GroupFailedError, Restart, run_agent
from longboat.launch.torch_noise import first_line, quiet_console

_PORT_ATTEMPTS = 5
#: Elastic jobs: a collective waiting this long on a silent peer gives up (LONGBOAT_TIMEOUT).
_ELASTIC_FAILURE_TIMEOUT_S = 30.0
_SHUTDOWN_GRACE_S = 3

add_arguments = options.add_arguments


def run(args: argparse.Namespace) -> int:
    """Entry point of the `launch` sub-command: the process ends with the launch's exit code.

    It ends through ``os._exit`` once the output is flushed: the interpreter's own shutdown
    would destroy torch's C++ rendezvous and store objects while their threads may still run,
    and std::terminate then turns the exit code into SIGABRT.
    """
    console = Console(highlight=False, soft_wrap=True)
    try:
        spec = options.spec_from_args(args)
    except LaunchOptionError as exc:
        console.print(f"longboat launch: {exc}", markup=False)
        return 2
    with quiet_console(_say(console), spec.log_dir, spec.node_rank):
        code = launch(spec, console)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _say(console: Console) -> Callable[[str], None]:
    """Print one longboat line as it is (never wrapped, no markup)."""
    return lambda line: console.print(line, markup=False, soft_wrap=True)


def launch(spec: LaunchSpec, console: Console) -> int:
    """Run ``spec`` on this node; 0 when every rank succeeded."""
    started = time.monotonic()
    explicit = spec.master_port is not None
    host = spec.master_host or "127.0.0.1"
    # elastic jobs: whichever node binds the endpoint first serves the rendezvous
    if explicit and spec.node_rank == 0 and not spec.elastic and not is_free("", spec.master_port):
        holder = holder_of(spec.master_port)
        console.print(
            f"longboat launch: port {spec.master_port} is already in use"
            + (f" by {holder}" if holder else "")
            + f"; pick another with --master {host}:PORT or leave the port out to get a free one",
            markup=False,
        )
        return 1
    try:
        claim = claim_log_dir(spec.log_dir, spec.node_rank, _command_line(spec))
    except LogDirBusyError as exc:
        console.print(f"longboat launch: {exc}", markup=False)
        return 2
    with claim, elastic_files(spec) as copies:
        return _launch(spec, console, started, host, explicit, copies)


def _launch(
    spec: LaunchSpec,
    console: Console,
    started: float,
    host: str,
    explicit: bool,
    copies: Path | None = None,
) -> int:
    quiet_torch_logging()
    my_ip = "127.0.0.1" if host in ("127.0.0.1", "localhost") else local_ip_towards(host)
    ports = spec.ports or [
        free_port(my_ip if my_ip != "127.0.0.1" else "127.0.0.1") for _ in range(spec.local_procs)
    ]
    env = _rank_env(spec, my_ip, ports)
    if copies is not None:
        env[ENV_COPY_DIR] = str(copies)
    run_id = _run_id(spec)
    logs = _logs(spec)

    def on_restart(restart: Restart) -> None:
        console.print(restart_line(restart), markup=False, soft_wrap=True)

    with patched_environ(env), signals_raise_in_main_thread():
        _drop_blank_variables()
        if spec.elastic:  # node rank and count come from each rendezvous round
            for name in ("LONGBOAT_NNODES", "LONGBOAT_NODE_RANK"):
                os.environ.pop(name, None)
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            port = spec.master_port or free_port()
            master = f"{host}:{port}"
            if attempt == 1:
                print_banner(spec, master, my_ip, _rows(spec, my_ip, ports), console)
                note = master_note(host, port, my_ip) if spec.nnodes > 1 else None
                if note is not None:
                    console.print(note, markup=False, soft_wrap=True)
                if spec.multinode_ps:
                    print_job_servers_later(master, spec.timeout, console)
            waiting = _waiting(spec, master, console)
            try:
                run_agent(
                    _config(spec, master, run_id, logs),
                    sys.executable,
                    _bootstrap_args(spec),
                    on_restart,
                    shutdown_grace_s=_SHUTDOWN_GRACE_S,
                    waiting=waiting,
                    fresh_stores=not spec.multinode_ps,  # there a node restarts alone
                    **_elastic_agent(spec, master, my_ip, console),
                )
                console.print(finished_line(spec, time.monotonic() - started), markup=False)
                return 0
            except RendezvousClosedError:
                console.print(
                    "longboat launch: the elastic job had finished before this node could join "
                    f"(the rendezvous on {master} is closed); nothing to do",
                    markup=False,
                )
                return 0
            except (RendezvousTimeoutError, DistError) as exc:
                if waiting.started:  # the ranks ran: not the rendezvous
                    raise
                console.print(gave_up_line(waiting, exc, my_ip), markup=False)
                return 1
            except RendezvousConnectionError as exc:
                if explicit or attempt == _PORT_ATTEMPTS:
                    console.print(
                        f"longboat launch: rendezvous on {master} failed: {first_line(exc)}",
                        markup=False,
                    )
                    return 1
            except GroupFailedError as exc:
                summary = failure_summary(
                    exc.report, spec.log_dir, socket.gethostname(), spec.servers, logs.names
                )
                console.print(summary, markup=False, soft_wrap=True)
                return 1
            except SignalException as exc:  # the agent has already ended every rank
                console.print(stopped_line(spec, exc.sigval), markup=False)
                return 128 + int(exc.sigval)
    return 1


def _waiting(spec: LaunchSpec, master: str, console: Console) -> RendezvousWait:
    """Who has arrived, while this node waits for the others (several nodes only)."""
    nodes = f"{spec.min_nodes}:{spec.nnodes}" if spec.elastic else str(spec.nnodes)
    every = REPORT_EVERY_S if spec.nnodes > 1 else None  # one node waits for nobody
    return RendezvousWait(
        lambda line: console.print(line, markup=False), master, nodes, spec.timeout, every
    )


def finished_line(spec: LaunchSpec, seconds: float) -> str:
    """The last line of a successful job: ranks, wall time and where the logs are."""
    n = spec.local_procs
    ranks = f"{n} rank{'s' if n != 1 else ''}" + (" on this node" if spec.nnodes > 1 else "")
    logs = os.path.join(spec.log_dir, "")
    return f"longboat launch: job finished successfully: {ranks}, {seconds:.1f} s, logs in {logs}"


def _command_line(spec: LaunchSpec) -> str:
    target = ["-m", spec.target] if spec.module else [spec.target]
    return " ".join(["longboat launch", *target, *spec.target_args])


def stopped_line(spec: LaunchSpec, sigval: signal.Signals) -> str:
    """The one line printed when the launcher itself is signalled (Ctrl-C, SIGTERM)."""
    n = spec.local_procs
    return (
        f"longboat launch: stopped by {sigval.name}; {n} rank{'s' if n != 1 else ''} ended, "
        f"logs in {os.path.join(spec.log_dir, '')}"
    )


def _run_id(spec: LaunchSpec) -> str:
    """The rendezvous run id: one shared by every node (LONGBOAT_RUN_ID, else the master
    endpoint, which every node is given), or a fresh one for a single-node job."""
    run_id = variable("LONGBOAT_RUN_ID")
    if run_id:
        return run_id
    if spec.nnodes > 1:
        return f"longboat-{spec.master_host}-{spec.master_port}".replace(":", "-")
    return f"longboat-{uuid.uuid4().hex[:10]}"


def _drop_blank_variables() -> None:
    """A longboat variable set to blank counts as unset (`longboat.cluster.env.variable`): the
    ranks do not get it at all (`patched_environ` restores it afterwards)."""
    for name in [n for n in VARIABLES if not os.environ.get(n, "x").strip()]:
        del os.environ[name]


def _logs(spec: LaunchSpec) -> WorkerLogs:
    """Where each rank logs (multi-node PS: named by this node's own role numbers)."""
    local_servers = spec.servers if spec.multinode_ps else None
    return WorkerLogs(spec.log_dir, _TeeRanks(spec), spec.servers, local_servers=local_servers)


def _config(spec: LaunchSpec, master: str, run_id: str, logs: WorkerLogs) -> LaunchConfig:
    """torch's launch settings for this node (the grace period goes to `run_agent`)."""
    return torch_compat.launch_config(
        min_nodes=spec.min_nodes or spec.nnodes,
        max_nodes=spec.nnodes,
        nproc_per_node=spec.local_procs,
        run_id=run_id,
        # static: the ranks' process group uses the banner's master endpoint; elastic jobs
        # need torch's c10d rendezvous (with sub-second timings), whose rounds admit and
        # drop nodes
        rdzv_backend=rendezvous.BACKEND if spec.elastic else "static",
        rdzv_endpoint=master,
        rdzv_configs={"join_timeout": spec.timeout, "read_timeout": rendezvous.STORE_READ_TIMEOUT_S}
        if spec.elastic
        else {"rank": spec.node_rank, "timeout": spec.timeout},
        max_restarts=spec.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=logs,
        log_line_prefix_template="[rank ${rank}] ",
    )


def _elastic_agent(spec: LaunchSpec, master: str, my_ip: str, console: Console) -> dict:
    """`run_agent`'s keyword arguments for an elastic job (none otherwise)."""
    if not spec.elastic:
        return {}
    rendezvous.register()

    def on_change(change: MembershipChange) -> None:
        console.print(membership_line(change), markup=False, soft_wrap=True)

    return {
        "agent_class": ElasticAgent,
        "elastic_dir": elastic_directory(spec.log_dir),
        "store_endpoint": master,
        "node_address": f"{my_ip}[{os.getpid()}]",  # the launcher's address and pid
        "on_change": on_change,
        "on_note": lambda text: console.print(f"longboat launch: {text}", markup=False),
    }


class _TeeRanks:
    """Which global ranks this console shows: trainer 0, or every rank with --tee all."""

    def __init__(self, spec: LaunchSpec):
        self.all = spec.tee_all
        self.first_trainer = spec.servers  # parameter-server mode: servers come first

    def __contains__(self, rank: object) -> bool:
        return self.all or rank == self.first_trainer


def _bootstrap_args(spec: LaunchSpec) -> list[str]:
    target = ["-m", spec.target] if spec.module else [spec.target]
    return ["-u", "-m", "longboat.launch.bootstrap", *target, *spec.target_args]


def _rank_env(spec: LaunchSpec, my_ip: str, ports: list[int]) -> dict[str, str]:
    """What every rank of this node inherits (torch's agent adds RANK, WORLD_SIZE, ...)."""
    env = {
        "LONGBOAT_HOST_IP": my_ip,
        "LONGBOAT_ENDPOINT_PORTS": ",".join(map(str, ports)),
        "LONGBOAT_LAUNCH_TIMEOUT": str(spec.timeout),
        "LONGBOAT_LOG_DIR": os.path.abspath(spec.log_dir),
        "PYTHONUNBUFFERED": "1",
    }
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // spec.local_procs))
    if spec.devices:
        env["LONGBOAT_DEVICES"] = ",".join(spec.devices)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(spec.devices)
    if spec.config:
        env["LONGBOAT_CONFIG"] = spec.config
    if spec.ps_checkpoint_dir:
        env["LONGBOAT_PS_CHECKPOINT_DIR"] = spec.ps_checkpoint_dir
    if spec.multinode_ps:  # the job-wide layout is gathered by the ranks at start-up
        env["LONGBOAT_LOCAL_SERVERS"] = str(spec.servers)
    elif spec.servers:
        env["LONGBOAT_NUM_SERVERS"] = str(spec.servers)
        if not (os.environ.get("LONGBOAT_PS_TOKEN") or os.environ.get("LONGBOAT_PS_TOKEN_FILE")):
            from longboat.ps.shared.auth import job_token_file  # a fresh token per job, 0600 file

            env["LONGBOAT_PS_TOKEN_FILE"] = job_token_file(spec.log_dir)
    if spec.elastic:  # the node count is the rendezvous round's (GROUP_WORLD_SIZE)
        env["LONGBOAT_ELASTIC_DIR"] = str(elastic_directory(spec.log_dir))
        # torch's shared store is announced only in the round where a node first becomes
        # rank 0, so a node joining a later round waits for it forever; elastic ranks form
        # their groups on the rendezvous store instead
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    else:
        env["LONGBOAT_NNODES"] = str(spec.nnodes)
    timeout = spec.failure_timeout
    if timeout is None and spec.elastic and not os.environ.get("LONGBOAT_TIMEOUT"):
        timeout = _ELASTIC_FAILURE_TIMEOUT_S
    if timeout is not None:
        env["LONGBOAT_TIMEOUT"] = f"{timeout:g}"
    if spec.nnodes == 1 and not spec.elastic:  # every endpoint is here: no exchange needed
        env["LONGBOAT_ALL_ENDPOINTS"] = ",".join(f"{my_ip}:{port}" for port in ports)
    return env


def _rows(spec: LaunchSpec, my_ip: str, ports: list[int]) -> list[dict[str, str]]:
    rows = []
    for local in range(spec.local_procs):
        rank = spec.node_rank * spec.local_procs + local
        role, index = role_of(rank, spec.servers)
        log = log_name(rank, spec.servers)
        if spec.multinode_ps:  # job-wide numbers are known once every node has started
            role, index = role_of(local, spec.servers)
            log = log_name(local, spec.servers)
        row = {
            "rank": "?" if spec.multinode_ps else str(rank),
            "local rank": str(local),
            "role": f"{role} {'local ' if spec.multinode_ps else ''}{index}"
            if spec.ps
            else "trainer",
            "endpoint": f"{my_ip}:{ports[local]}",
            "device": spec.devices[local] if spec.devices else "cpu/auto",
            "log": os.path.join(spec.log_dir, log),
        }
        rows.append(row)
    return rows
