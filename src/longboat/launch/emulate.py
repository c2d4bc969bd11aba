"""`longboat emulate`: N emulated nodes on this machine, each running `longboat launch`.

Each node is a network namespace with one veth link to a shared bridge, rate-limited with tbf on
both ends (see `longboat.launch.netns`). The launchers' output is streamed prefixed ``[node i]``;
if one fails the others are stopped, and every namespace, veth and bridge is removed on the way
out: on success, failure, Ctrl-C or SIGTERM.

Elastic runs (``--min-nodes`` or any fault flag, see `longboat.launch.faults`) give every
launcher ``--nnodes MIN:MAX`` and a rendezvous store hosted here, on the bridge's address, so it
outlives any node; emulate then kills nodes, cuts and restores links and adds nodes on cue.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from rich.table import Table

from longboat.console import table_console
from longboat.launch import faults, netns
from longboat.launch.emulate_args import DEFAULT_PORT as DEFAULT_PORT
from longboat.launch.emulate_args import add_arguments
from longboat.launch.emulate_commands import TORCHRUN_MAX_RESTARTS as TORCHRUN_MAX_RESTARTS
from longboat.launch.emulate_commands import TORCHRUN_RDZV_CONF as TORCHRUN_RDZV_CONF
from longboat.launch.emulate_commands import (
    EmulateError,
    launcher_command,
    ps_roles,
)
from longboat.launch.emulate_commands import node_env as node_env
from longboat.launch.emulate_commands import torchrun_command as torchrun_command
from longboat.launch.emulate_nodes import STOP_GRACE_S as STOP_GRACE_S
from longboat.launch.emulate_nodes import (
    Injector,
    NodeCommand,
    NodeRun,
    commit_dirs,
    start_node,
    stop_all,
    wait_all,
)
from longboat.launch.faults import FaultPlan
from longboat.launch.netns import Node, Plan
from longboat.log import get_logger

__all__ = ["EmulateError", "add_arguments", "cleanup_stale", "launcher_command", "run"]

cleanup_stale = netns.cleanup_stale

_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")

_log = get_logger("longboat.emulate")


class _Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def run(args: argparse.Namespace, node_command: NodeCommand | None = None) -> int:
    """Entry point of `longboat emulate`; returns the process exit code.

    ``node_command`` replaces `launcher_command` (what each node runs), e.g. in tests.
    """
    try:
        check_environment(need_tc=not args.cleanup)
        if args.cleanup:
            return _run_cleanup()
        plan, schedule = _prepare(args)
    except (EmulateError, ValueError, netns.NetnsError) as exc:
        _log.error("%s", exc)
        return 2
    return _run_plan(plan, args, schedule, node_command or launcher_command)


def _run_cleanup() -> int:
    removed = netns.cleanup_stale()
    if removed:
        _log.info("removed %d stale object(s): %s", len(removed), ", ".join(removed))
    else:
        _log.info("no stale longboat emulate namespaces or links found")
    return 0


# ---------------------------------------------------------------- preflight


def check_environment(need_tc: bool = True) -> None:
    """Root rights and the `ip`/`tc` tools, checked before anything is created."""
    if os.geteuid() != 0:
        raise EmulateError(
            "longboat emulate needs root to create network namespaces (run it as root, e.g. "
            "with sudo)"
        )
    tools = ["ip", "tc"] if need_tc else ["ip"]
    for tool in tools:
        if shutil.which(tool) is None:
            raise EmulateError(f"the `{tool}` command was not found; install iproute2")


def fault_plan(args: argparse.Namespace) -> FaultPlan:
    """The run's faults and elastic shape from ``args`` (raises `faults.FaultError`)."""
    return faults.plan_faults(
        args.nodes,
        getattr(args, "min_nodes", None),
        kill=getattr(args, "kill_node", None) or (),
        cut=getattr(args, "cut_link", None) or (),
        restore=getattr(args, "restore_link", None) or (),
        add=getattr(args, "add_node", None) or (),
    )


def _prepare(args: argparse.Namespace) -> tuple[Plan, FaultPlan]:
    """Validate the arguments and plan the run; the only object created is netem's scratch link."""
    if not args.script:
        raise EmulateError("no script given: longboat emulate [options] -- script.py [args]")
    if not Path(args.script).is_file():
        raise EmulateError(f"script {args.script!r} not found (relative to {os.getcwd()})")
    if args.nproc_per_node < 1:
        raise EmulateError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    if not 1 <= args.master_port <= 65535:
        raise EmulateError(f"--master-port {args.master_port} is not a TCP port (1-65535)")
    if getattr(args, "max_restarts", 0) < 0:
        raise EmulateError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    schedule = fault_plan(args)
    if ps_roles(args) is not None and schedule.elastic:
        raise EmulateError("parameter-server runs are static: drop --min-nodes and the faults")
    rate = netns.parse_rate(args.bandwidth)
    latency = netns.parse_latency(args.latency) if args.latency else None
    plan = netns.make_plan(
        args.nodes,
        rate,
        latency,
        run_id=args.run_id,
        spares=schedule.spares,
        bridge_address=schedule.elastic,
    )
    if latency and not netns.netem_available(plan.run_id):
        raise EmulateError(
            f"--latency {args.latency} needs the netem qdisc (sch_netem), which this kernel "
            "does not provide (`tc qdisc add ... netem` fails); drop --latency or load sch_netem"
        )
    return plan, schedule


# ---------------------------------------------------------------- the run


def _run_plan(
    plan: Plan,
    args: argparse.Namespace,
    schedule: FaultPlan | None = None,
    node_command: NodeCommand | None = None,
) -> int:
    """Build, launch, wait and tear down; signals become a clean shutdown."""
    schedule = schedule or FaultPlan(nodes=len(plan.nodes))
    command = node_command or launcher_command
    log_dir = Path(args.log_dir or Path(tempfile.gettempdir()) / f"longboat-emulate-{plan.run_id}")
    token_file = _ps_token_file(args, log_dir)
    runs: list[NodeRun] = []
    store: Any = None
    with _signals_raise():
        try:
            _log.info("building %d emulated nodes (run %s)", len(plan.initial_nodes), plan.run_id)
            netns.setup(plan)
            print_topology(plan)
            _log.info("launcher logs: %s/node<i>", log_dir)
            master = None
            if schedule.elastic:
                store, port = _host_store(plan, args.master_port)
                master = f"{plan.bridge_address}:{port}"
                _clear_commits(plan, log_dir)
                _log.info(
                    "elastic run: --nnodes %d:%d, rendezvous on %s (this process)",
                    schedule.min_nodes,
                    schedule.max_nodes,
                    master,
                )

            def start(node: Node) -> NodeRun:
                return start_node(plan, node, args, log_dir, command, master, token_file)

            for node in plan.initial_nodes:
                runs.append(start(node))
            injector = Injector(plan, schedule, log_dir, start) if schedule.faults else None
            return wait_all(runs, args.keep_going, args.timeout, injector)
        except _Interrupted as exc:
            _log.warning("got %s: stopping all nodes and cleaning up", exc)
            return 128 + exc.signum
        except netns.NetnsError as exc:
            _log.error("could not build the emulated network: %s", exc)
            return 1
        finally:
            with _signals_ignored():
                stop_all(runs)
                netns.teardown(plan)
                _log.info("removed namespaces, veths and bridge of run %s", plan.run_id)
                del store  # the rendezvous store lives until every node is gone


def _ps_token_file(args: argparse.Namespace, log_dir: Path) -> str | None:
    """A parameter-server run without a token of the user's: one fresh 0600 token file that
    every emulated node reads (they share this machine's filesystem)."""
    if ps_roles(args) is None or os.environ.get("LONGBOAT_PS_TOKEN"):
        return None
    if os.environ.get("LONGBOAT_PS_TOKEN_FILE"):
        return None
    from longboat.ps.shared.auth import job_token_file

    return job_token_file(log_dir)


def _host_store(plan: Plan, port: int) -> tuple[Any, int]:
    """The elastic rendezvous store, served by this process on the bridge's address.

    Falls back to a free port when ``port`` is taken in the root namespace.
    """
    from datetime import timedelta

    import torch.distributed as dist

    def serve(p: int) -> Any:
        return dist.TCPStore(
            plan.bridge_address,
            p,
            is_master=True,
            wait_for_workers=False,
            multi_tenant=True,
            timeout=timedelta(seconds=30),
        )

    try:
        store = serve(port)
    except (RuntimeError, OSError) as exc:
        store = serve(0)
        _log.warning("port %d is taken (%s); the rendezvous uses port %d", port, exc, store.port)
    return store, int(store.port)


def _clear_commits(plan: Plan, log_dir: Path) -> None:
    """Remove step counts an earlier run left in these log directories (step triggers read them)."""
    for directory in commit_dirs(plan, log_dir):
        for path in directory.glob("commits-*"):
            with contextlib.suppress(OSError):
                path.unlink()


# ---------------------------------------------------------------- console


def print_topology(plan: Plan) -> None:
    """The emulated cluster as a table (node, namespace, address, interface, bridge port) under
    one line with the shaping every link shares; it fits 100 columns."""
    latency = f", {plan.latency_s * 1e3:g} ms latency" if plan.latency_s else ""
    bridge = plan.bridge + (f" ({plan.bridge_address}, rendezvous)" if plan.bridge_address else "")
    table = Table(
        title=f"longboat emulate: run {plan.run_id}, bridge {bridge}",
        caption=f"every link: {plan.rate} (burst {plan.burst_bytes // 1024} KiB){latency}",
    )
    for column in ("node", "namespace", "address", "interface", "bridge port"):
        table.add_column(column, no_wrap=True)
    spares = {n.index for n in plan.nodes[len(plan.initial_nodes) :]}
    for n in plan.nodes:
        table.add_row(
            f"{n.index} (spare)" if n.index in spares else str(n.index),
            n.namespace,
            f"{n.address}/{plan.subnet.prefixlen}",
            n.ifname,
            n.bridge_port,
        )
    table_console(stderr=True).print(table)


# ---------------------------------------------------------------- signals


def _raise_interrupted(signum: int, frame: object) -> None:
    raise _Interrupted(signum)


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGINT/SIGTERM/SIGHUP raise `_Interrupted` in the main thread; old handlers come back."""
    with _handlers(_raise_interrupted):
        yield


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    """Cleanup runs to the end: a second Ctrl-C must not leave half the network behind."""
    with _handlers(signal.SIG_IGN):
        yield


@contextlib.contextmanager
def _handlers(
    handler: Callable[[int, FrameType | None], Any] | int | signal.Handlers,
) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signums = [getattr(signal, n) for n in _SIGNALS if hasattr(signal, n)]
    saved = {s: signal.getsignal(s) for s in signums}
    for s in signums:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, old in saved.items():
            signal.signal(s, old if old is not None else signal.SIG_DFL)
