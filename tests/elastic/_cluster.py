"""Several `longboat launch --nnodes MIN:MAX` launchers on this machine, each a "node", for the
elastic tests; every launcher and rank is gone when the context ends, whatever happened."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

PROBE = Path(__file__).with_name("elastic_probe.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalCluster:
    """Launchers started with `start`; `wait` collects their consoles."""

    root: Path
    nnodes: str
    env: dict[str, str]
    args: list[str] = field(default_factory=list)  # more `longboat launch` options
    port: int = field(default_factory=free_port)
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    def start(self, **env: str) -> int:
        """Start one more node, with ``env`` on top of the cluster's; returns its index (its
        log dir is ``root/node<i>``, its ranks see ``PROBE_NODE=<i>``)."""
        index = len(self.procs)
        env = dict(
            os.environ,
            **self.env,
            **{k: str(v) for k, v in env.items()},
            PROBE_PID_DIR=str(self.pid_dir),
            PROBE_NODE=str(index),
        )
        self.procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "longboat",
                    "launch",
                    "--nnodes",
                    self.nnodes,
                    "--master",
                    f"127.0.0.1:{self.port}",
                    "--log-dir",
                    str(self.log_dir(index)),
                    *self.args,
                    str(PROBE),
                ],
                cwd=self.root,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
        return index

    @property
    def pid_dir(self) -> Path:
        path = self.root / "pids"
        path.mkdir(exist_ok=True)
        return path

    def log_dir(self, index: int) -> Path:
        return self.root / f"node{index}"

    def commits(self) -> int:
        """The most steps any rank has committed so far."""
        best = 0
        for path in self.root.glob("node*/.elastic/commits-*"):
            with contextlib.suppress(OSError, ValueError):
                best = max(best, int(path.read_text()))
        return best

    def wait_for_commits(self, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.commits() < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no rank committed {n} steps within {timeout:.0f}s")
            time.sleep(0.05)

    def wait(self, timeout: float = 120) -> list[tuple[int, str]]:
        """Every launcher's (exit code, console)."""
        out = []
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            text, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((proc.returncode, text))
        return out

    def leave(self, index: int, timeout: float = 60) -> int:
        """SIGTERM node ``index``'s launcher and ranks (the node leaves); its exit code. A node
        still running after ``timeout`` is killed and the wait fails."""
        proc = self.procs[index]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            raise

    def stop(self) -> None:
        """SIGTERM every launcher (its agent stops its ranks), then SIGKILL what is left."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for path in self.pid_dir.glob("pid.*"):
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(path.read_text()), signal.SIGKILL)


@contextlib.contextmanager
def local_cluster(
    root: Path, nnodes: str, args: tuple[str, ...] = (), **env: str
) -> Iterator[LocalCluster]:
    """Launchers whose rendezvous store is served here, so any of them may be lost (as a
    store on a machine that outlives the job would be); ``args``: more launch options."""
    import torch.distributed as dist

    cluster = LocalCluster(root, nnodes, {k: str(v) for k, v in env.items()}, list(args))
    store = dist.TCPStore(
        "127.0.0.1", cluster.port, is_master=True, wait_for_workers=False, multi_tenant=True
    )
    try:
        yield cluster
    finally:
        cluster.stop()
        del store
