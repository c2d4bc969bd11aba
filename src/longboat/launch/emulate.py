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
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any

from rich.console import Console
from rich.table import Table

from longboat.launch import faults, netns
from longboat.launch.faults import Fault, FaultPlan
from longboat.launch.netns import Node, Plan
from longboat.log import get_logger

__all__ = ["EmulateError", "add_arguments", "cleanup_stale", "launcher_command", "run"]

cleanup_stale = netns.cleanup_stale

DEFAULT_PORT = 29500
#: ``--launcher torchrun`` in elastic runs: restarts torchrun may spend on lost nodes.
TORCHRUN_MAX_RESTARTS = 3
#: After a failure or signal, launchers get this long to stop their ranks before SIGKILL.
STOP_GRACE_S = 5.0
_POLL_S = 0.1
_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")

_log = get_logger("longboat.emulate")

#: Builds one node's command: ``(plan, node, args, log_dir, master=HOST:PORT) -> argv``.
NodeCommand = Callable[..., list[str]]


class EmulateError(RuntimeError):
    """A precondition failed (rights, tools, arguments); nothing was created."""


class _Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class _NodeRun:
    """One node's launcher process and the thread copying its output to the console."""

    node: Node
    proc: subprocess.Popen[bytes]
    pump: threading.Thread
    started: float = field(default_factory=time.monotonic)
    #: why a failure of this node is not the job's (set when emulate injects a fault into it)
    faulted: str | None = None


# ---------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `longboat emulate`'s options on ``parser``."""
    parser.add_argument("--nodes", type=int, default=2, help="emulated nodes (default 2)")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="ranks per node (default 1)")
    parser.add_argument(
        "--bandwidth",
        default="1gbit",
        help="each node's link rate, both directions, in tc units (default 1gbit)",
    )
    parser.add_argument(
        "--latency",
        default=None,
        help="one-way node-to-node delay, e.g. 10ms (needs the kernel's netem qdisc)",
    )
    parser.add_argument(
        "--keep-going",
        action="store_true",
        help="when a node fails, let the other nodes run on instead of stopping them",
    )
    parser.add_argument(
        "--master-port",
        type=int,
        default=DEFAULT_PORT,
        help="rendezvous port on node 0 (elastic runs: on the bridge, hosted by emulate)",
    )
    ps = parser.add_argument_group(
        "parameter-server runs",
        "--server-nodes K --servers S --workers W: the first K nodes run only servers (S spread "
        "evenly), the other nodes only trainers (W spread evenly); replaces --nproc-per-node",
    )
    ps.add_argument(
        "--server-nodes", type=int, default=None, metavar="K", help="nodes that run only servers"
    )
    ps.add_argument("--servers", type=int, default=None, metavar="S", help="servers in the job")
    ps.add_argument("--workers", type=int, default=None, metavar="W", help="trainers in the job")
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="static runs: each node's launcher restarts its ranks up to this many times",
    )
    elastic = parser.add_argument_group(
        "elastic runs and faults",
        "Any of these makes the run elastic: launchers get --nnodes MIN:MAX (MAX = --nodes plus "
        "one per --add-node) and a rendezvous hosted by emulate on the bridge. WHEN is a time "
        "since all nodes started (10s, 2.5s) or a training step (step=5: once any node's "
        "highest committed step reaches 5). A node emulate killed, or whose link it cut, does "
        "not fail the run.",
    )
    elastic.add_argument(
        "--min-nodes",
        type=int,
        default=None,
        metavar="M",
        help="run elastic with --nnodes M:MAX (1 <= M <= --nodes; default 1 when faults are given)",
    )
    elastic.add_argument(
        "--kill-node",
        action="append",
        default=[],
        metavar="NODE@WHEN",
        help="SIGKILL every process of node NODE (launcher and ranks) at WHEN; repeatable",
    )
    elastic.add_argument(
        "--cut-link",
        action="append",
        default=[],
        metavar="NODE@WHEN",
        help="take node NODE's link down (both veth ends) at WHEN; repeatable",
    )
    elastic.add_argument(
        "--restore-link",
        action="append",
        default=[],
        metavar="NODE@WHEN",
        help="bring node NODE's link up again at WHEN (after a --cut-link of it); repeatable",
    )
    elastic.add_argument(
        "--add-node",
        action="append",
        default=[],
        metavar="WHEN",
        help="start one more node (a spare namespace, the next index) at WHEN; repeatable",
    )
    parser.add_argument(
        "--log-dir", default=None, help="per-node launcher logs go to LOG_DIR/node<i>"
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="stop all nodes after this many seconds"
    )
    parser.add_argument(
        "--launcher",
        choices=("longboat", "torchrun"),
        default="longboat",
        help="what each node runs: `longboat launch` (default) or plain torchrun",
    )
    parser.add_argument(
        "--run-id", default=None, help="6 hex digits naming this run's objects (default: random)"
    )
    parser.add_argument(
        "--cleanup",
        action="store_true",
        help="remove namespaces/links left by crashed earlier runs, then exit",
    )
    parser.add_argument("script", nargs="?", help="training script each rank runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")


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
    runs: list[_NodeRun] = []
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

            def start(node: Node) -> _NodeRun:
                return _start_node(plan, node, args, log_dir, command, master, token_file)

            for node in plan.initial_nodes:
                runs.append(start(node))
            injector = _Injector(plan, schedule, log_dir, start) if schedule.faults else None
            return _wait(runs, args.keep_going, args.timeout, injector)
        except _Interrupted as exc:
            _log.warning("got %s: stopping all nodes and cleaning up", exc)
            return 128 + exc.signum
        except netns.NetnsError as exc:
            _log.error("could not build the emulated network: %s", exc)
            return 1
        finally:
            with _signals_ignored():
                _stop(runs)
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
    from longboat.ps.auth import job_token_file

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
    for directory in _commit_dirs(plan, log_dir):
        for path in directory.glob("commits-*"):
            with contextlib.suppress(OSError):
                path.unlink()


def _commit_dirs(plan: Plan, log_dir: Path) -> list[Path]:
    return [log_dir / f"node{n.index}" / ".elastic" for n in plan.nodes]


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


_console_lock = threading.Lock()


def _pump(stream: IO[bytes], node: int) -> None:
    """Copy a launcher's output to our stdout, line by line, prefixed ``[node i]``."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        with _console_lock:
            sys.stdout.write(f"[node {node}] {line}\n")
            sys.stdout.flush()
    stream.close()


def _announce(text: str) -> None:
    """One ``[emulate] ...`` console line (an injected fault)."""
    with _console_lock:
        sys.stdout.write(f"[emulate] {text}\n")
        sys.stdout.flush()


def _start_node(
    plan: Plan,
    node: Node,
    args: argparse.Namespace,
    log_dir: Path,
    command: NodeCommand | None = None,
    master: str | None = None,
    token_file: str | None = None,
) -> _NodeRun:
    """Start the node's launcher in its namespace and its own process group."""
    argv = (command or launcher_command)(plan, node, args, log_dir, master=master)
    env = node_env(plan, node)
    if token_file:
        env["LONGBOAT_PS_TOKEN_FILE"] = token_file
    proc = subprocess.Popen(
        ["ip", "netns", "exec", node.namespace, *argv],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    assert proc.stdout is not None
    pump = threading.Thread(target=_pump, args=(proc.stdout, node.index), daemon=True)
    pump.start()
    return _NodeRun(node, proc, pump)


class _Injector:
    """Fires a run's faults when their time or step comes (polled by `_wait`)."""

    def __init__(
        self,
        plan: Plan,
        schedule: FaultPlan,
        log_dir: Path,
        start: Callable[[Node], _NodeRun],
    ):
        self.plan = plan
        self.pending: list[Fault] = list(schedule.faults)
        self.began = time.monotonic()
        self.spares = list(plan.nodes[len(plan.initial_nodes) :])
        self.started: set[int] = {n.index for n in plan.initial_nodes}
        self.cut: set[int] = set()  # links cut at some point (their node's failure is forgiven)
        self.down: set[int] = set()  # links down now
        self._dirs = _commit_dirs(plan, log_dir)
        self._start = start
        self._watch_steps = any(f.when.step is not None for f in self.pending)

    def poll(self, runs: list[_NodeRun]) -> None:
        """Fire every due fault; an added node's run is appended to ``runs``."""
        if not self.pending:
            return
        elapsed = time.monotonic() - self.began
        step = faults.highest_step(self._dirs) if self._watch_steps else -1
        for fault in list(self.pending):
            if not fault.when.due(elapsed, step) or not self._ready(fault):
                continue
            self.pending.remove(fault)
            moment = f"at {elapsed:.1f} s"
            if fault.when.step is not None:
                moment = f"at step {step} ({elapsed:.1f} s)"
            try:
                self._fire(fault, runs, moment)
            except netns.NetnsError as exc:
                _log.error("%s failed: %s", fault.flag, exc)

    def _ready(self, fault: Fault) -> bool:
        """A kill waits for its node to start, a restore for the cut it undoes."""
        if fault.kind == "kill":
            return fault.node in self.started
        if fault.kind == "restore":
            return fault.node in self.down
        return fault.kind != "add" or bool(self.spares)

    def _fire(self, fault: Fault, runs: list[_NodeRun], moment: str) -> None:
        if fault.kind == "add":
            node = self.spares.pop(0)
            runs.append(self._start(node))
            self.started.add(node.index)
            self._mark(runs, node.index, "link cut" if node.index in self.cut else None)
            _announce(f"added node {node.index} {moment}")
            return
        assert fault.node is not None
        node = self.plan.nodes[fault.node]
        if fault.kind == "kill":
            self._mark(runs, node.index, "killed by emulate")
            for r in runs:
                if r.node.index == node.index:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(r.proc.pid, signal.SIGKILL)
            netns.kill_namespace(node.namespace)
            _announce(f"killed node {node.index} {moment}")
        elif fault.kind == "cut":
            netns.set_link(self.plan, node, up=False)
            self.cut.add(node.index)
            self.down.add(node.index)
            self._mark(runs, node.index, "link cut by emulate")
            _announce(f"cut link of node {node.index} {moment}")
        else:
            netns.set_link(self.plan, node, up=True)
            self.down.discard(node.index)
            _announce(f"restored link of node {node.index} {moment}")

    @staticmethod
    def _mark(runs: list[_NodeRun], index: int, why: str | None) -> None:
        for r in runs:
            if r.node.index == index and why and r.faulted is None:
                r.faulted = why

    def report_unfired(self) -> None:
        for fault in self.pending:
            _log.warning("%s did not fire: the run ended first", fault.flag)


def _wait(
    runs: list[_NodeRun],
    keep_going: bool,
    timeout: float | None,
    injector: _Injector | None = None,
) -> int:
    """Wait for every launcher; on the first failure stop the rest (unless ``keep_going``).

    Nodes emulate faulted (`_NodeRun.faulted`) may fail without failing the run. Returns 0, or
    the first failed node's exit code (1 for a signal), naming the node.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    first: _NodeRun | None = None
    while any(r.proc.poll() is None for r in runs):
        if injector is not None:
            injector.poll(runs)
        if first is None:
            first = next((r for r in runs if _failed(r)), None)
            if first is not None:
                _log.error("node %d: %s", first.node.index, _describe(first.proc.returncode))
                if not keep_going:
                    _log.error("stopping the other nodes")
                    _stop(runs)
        if deadline is not None and time.monotonic() > deadline:
            _log.error("the run did not finish within %g s; stopping all nodes", timeout)
            _stop(runs)
            return 124
        time.sleep(_POLL_S)
    _join_pumps(runs)
    if injector is not None:
        injector.report_unfired()
    return _summarise(runs, first)


def _failed(run: _NodeRun) -> bool:
    """Whether ``run`` ended with an error that counts (not one emulate caused)."""
    return run.proc.poll() not in (None, 0) and run.faulted is None


def _describe(code: int) -> str:
    if code < 0:
        return f"its launcher was killed by {signal.Signals(-code).name}"
    return f"its launcher exited with code {code}"


def _summarise(runs: list[_NodeRun], first: _NodeRun | None) -> int:
    faulted = [r for r in runs if r.faulted is not None]
    for r in faulted:
        _log.info(
            "node %d (%s): %s; not counted as a failure",
            r.node.index,
            r.faulted,
            "finished successfully" if r.proc.returncode == 0 else _describe(r.proc.returncode),
        )
    first = first or next((r for r in runs if _failed(r)), None)
    if first is None:
        if faulted:
            healthy = len(runs) - len(faulted)
            nodes = "1 node" if healthy == 1 else f"{healthy} nodes"
            _log.info("every node not faulted finished successfully (%s)", nodes)
        else:
            _log.info("all %d nodes finished successfully", len(runs))
        return 0
    others = [
        f"node {r.node.index} ({r.proc.returncode})" for r in runs if r is not first and _failed(r)
    ]
    code = first.proc.returncode
    _log.error(
        "node %d failed: %s%s",
        first.node.index,
        _describe(code),
        f"; then {', '.join(others)}" if others else "",
    )
    return code if code > 0 else 1


def _stop(runs: list[_NodeRun], grace: float = STOP_GRACE_S) -> None:
    """SIGTERM each launcher's process group, then SIGKILL whatever is left in the namespaces."""
    live = [r for r in runs if r.proc.poll() is None]
    for r in live:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(r.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(r.proc.poll() is None for r in live) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    for r in runs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(r.proc.pid, signal.SIGKILL)
        # ranks started by torch's agent live in sessions of their own: find them by namespace
        netns.kill_namespace_processes(r.node.namespace)
        with contextlib.suppress(subprocess.TimeoutExpired):
            r.proc.wait(timeout=grace)
    _join_pumps(runs)


def _join_pumps(runs: list[_NodeRun]) -> None:
    for r in runs:
        r.pump.join(timeout=2.0)


# ---------------------------------------------------------------- console


def print_topology(plan: Plan) -> None:
    """The emulated cluster as a table: node, namespace, address, interfaces, shaping."""
    latency = f"{plan.latency_s * 1e3:g} ms" if plan.latency_s else "-"
    bridge = plan.bridge + (f" ({plan.bridge_address}, rendezvous)" if plan.bridge_address else "")
    table = Table(title=f"longboat emulate: run {plan.run_id}, bridge {bridge}")
    for column in ("node", "namespace", "address", "interface", "bridge port", "rate", "latency"):
        table.add_column(column, no_wrap=True)
    spares = {n.index for n in plan.nodes[len(plan.initial_nodes) :]}
    for n in plan.nodes:
        rate = f"{plan.rate} (burst {plan.burst_bytes // 1024} KiB)"
        table.add_row(
            f"{n.index} (spare)" if n.index in spares else str(n.index),
            n.namespace,
            f"{n.address}/{plan.subnet.prefixlen}",
            n.ifname,
            n.bridge_port,
            rate,
            latency,
        )
    console = Console(stderr=True)
    if not console.is_terminal:  # a log file or pipe: do not squeeze the table into 80 columns
        console = Console(stderr=True, width=160)
    console.print(table)


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
