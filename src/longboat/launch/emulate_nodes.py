"""The emulated nodes' launcher processes: start each in its namespace with its output
streamed ``[node i]``, fire the run's faults on cue, wait, stop and summarise."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from longboat.launch import faults, netns
from longboat.launch.emulate_commands import launcher_command, node_env
from longboat.launch.faults import Fault, FaultPlan
from longboat.launch.netns import Node, Plan
from longboat.log import get_logger
from longboat.words import plural

#: After a failure or signal, launchers get this long to stop their ranks before SIGKILL.
STOP_GRACE_S = 5.0
_POLL_S = 0.1

_log = get_logger("longboat.emulate")

#: Builds one node's command: ``(plan, node, args, log_dir, master=HOST:PORT) -> argv``.
NodeCommand = Callable[..., list[str]]


@dataclass
class NodeRun:
    """One node's launcher process and the thread copying its output to the console."""

    node: Node
    proc: subprocess.Popen[bytes]
    pump: threading.Thread
    started: float = field(default_factory=time.monotonic)
    #: why a failure of this node is not the job's (set when emulate injects a fault into it)
    faulted: str | None = None


def commit_dirs(plan: Plan, log_dir: Path) -> list[Path]:
    """Where each node's launcher writes its committed step counts (step triggers read them)."""
    return [log_dir / f"node{n.index}" / ".elastic" for n in plan.nodes]


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


def start_node(
    plan: Plan,
    node: Node,
    args: argparse.Namespace,
    log_dir: Path,
    command: NodeCommand | None = None,
    master: str | None = None,
    token_file: str | None = None,
) -> NodeRun:
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
    return NodeRun(node, proc, pump)


class Injector:
    """Fires a run's faults when their time or step comes (polled by `wait_all`)."""

    def __init__(
        self,
        plan: Plan,
        schedule: FaultPlan,
        log_dir: Path,
        start: Callable[[Node], NodeRun],
    ):
        self.plan = plan
        self.pending: list[Fault] = list(schedule.faults)
        self.began = time.monotonic()
        self.spares = list(plan.nodes[len(plan.initial_nodes) :])
        self.started: set[int] = {n.index for n in plan.initial_nodes}
        self.cut: set[int] = set()  # links cut at some point (their node's failure is forgiven)
        self.down: set[int] = set()  # links down now
        self._dirs = commit_dirs(plan, log_dir)
        self._start = start
        self._watch_steps = any(f.when.step is not None for f in self.pending)
        self.joining: list[int] = []  # added nodes whose ranks have not committed yet

    def poll(self, runs: list[NodeRun]) -> None:
        """Fire every due fault (an added node's run is appended to ``runs``), and say when an
        added node has joined."""
        self._announce_joined()
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

    def _fire(self, fault: Fault, runs: list[NodeRun], moment: str) -> None:
        if fault.kind == "add":
            node = self.spares.pop(0)
            runs.append(self._start(node))
            self.started.add(node.index)
            self._mark(runs, node.index, "link cut" if node.index in self.cut else None)
            self.joining.append(node.index)
            _announce(f"started node {node.index} {moment}; it joins the job at a later commit")
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
    def _mark(runs: list[NodeRun], index: int, why: str | None) -> None:
        for r in runs:
            if r.node.index == index and why and r.faulted is None:
                r.faulted = why

    def _announce_joined(self) -> None:
        """An added node has joined once its ranks record a commit: the job's count then (or
        a later one, if several commits came between two polls)."""
        for index in list(self.joining):
            commits = faults.highest_step([self._dirs[index]])
            if commits >= 0:
                self.joining.remove(index)
                _announce(f"node {index} joined the job by commit {commits}")

    def report_unfired(self) -> None:
        self._announce_joined()
        for fault in self.pending:
            _log.warning("%s did not fire: the run ended first", fault.flag)
        for index in self.joining:
            _log.warning("node %d was started but never committed a step with the job", index)


def wait_all(
    runs: list[NodeRun],
    keep_going: bool,
    timeout: float | None,
    injector: Injector | None = None,
) -> int:
    """Wait for every launcher; on the first failure stop the rest (unless ``keep_going``).

    Nodes emulate faulted (`NodeRun.faulted`) may fail without failing the run. Returns 0, or
    the first failed node's exit code (1 for a signal), naming the node.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    first: NodeRun | None = None
    while any(r.proc.poll() is None for r in runs):
        if injector is not None:
            injector.poll(runs)
        if first is None:
            first = next((r for r in runs if _failed(r)), None)
            if first is not None:
                _log.error("node %d: %s", first.node.index, _describe(first.proc.returncode))
                if not keep_going:
                    _log.error("stopping the other nodes")
                    stop_all(runs)
        if deadline is not None and time.monotonic() > deadline:
            _log.error("the run did not finish within %g s; stopping all nodes", timeout)
            stop_all(runs)
            return 124
        time.sleep(_POLL_S)
    _join_pumps(runs)
    if injector is not None:
        injector.report_unfired()
    return _summarise(runs, first)


def _failed(run: NodeRun) -> bool:
    """Whether ``run`` ended with an error that counts (not one emulate caused)."""
    return run.proc.poll() not in (None, 0) and run.faulted is None


def _describe(code: int) -> str:
    if code < 0:
        return f"its launcher was killed by {signal.Signals(-code).name}"
    return f"its launcher exited with code {code}"


def _summarise(runs: list[NodeRun], first: NodeRun | None) -> int:
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
            nodes = plural(len(runs) - len(faulted), "node")
            _log.info("every node not faulted finished successfully (%s)", nodes)
        elif len(runs) == 1:
            _log.info("the node finished successfully")
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


def stop_all(runs: list[NodeRun], grace: float = STOP_GRACE_S) -> None:
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


def _join_pumps(runs: list[NodeRun]) -> None:
    for r in runs:
        r.pump.join(timeout=2.0)
