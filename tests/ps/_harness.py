"""Servers for the parameter-server tests (threads of the test process) and trainer bodies."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from longboat.ps.server import Server
from longboat.ps.shared.auth import generate_token


@contextlib.contextmanager
def servers(
    n: int = 2,
    *,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int = 0,
    **settings: Any,
) -> Iterator[tuple[list[str], str]]:
    """``n`` started servers on free ports of 127.0.0.1: yields (endpoints, token); stops them.
    ``settings`` go to every ``Server`` (e.g. ``limits``, ``max_bytes``)."""
    token = generate_token()
    started: list[Server] = []
    try:
        for i in range(n):
            s = Server(
                "127.0.0.1:0",
                index=i,
                num_servers=n,
                token=token,
                checkpoint_dir=checkpoint_dir,
                checkpoint_every=checkpoint_every,
                **settings,
            )
            started.append(s.start())
        yield [s.endpoint for s in started], token
    finally:
        for s in started:
            s.stop(0)


@contextlib.contextmanager
def server_processes(
    n: int, token: str, checkpoint_dir: Path | None = None, env: dict[str, str] | None = None
) -> Iterator[list[ServerProcess]]:
    """``n`` servers as real processes (``python -m longboat.ps.server``); all killed at exit."""
    procs: list[ServerProcess] = []
    try:
        for i in range(n):  # start all, then wait for all: their imports overlap
            procs.append(ServerProcess(i, n, token, checkpoint_dir, env))
            procs[-1].start()
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        for p in procs:
            p.kill()


class ServerProcess:
    """One server process; ``restart()`` starts it again on the same endpoint."""

    def __init__(
        self,
        index: int,
        n: int,
        token: str,
        checkpoint_dir: Path | None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.index, self.n, self.token, self.checkpoint_dir = index, n, token, checkpoint_dir
        self.env = env or {}
        self.endpoint = "127.0.0.1:0"
        self.proc: subprocess.Popen | None = None
        self._port_file = Path(tempfile.mkdtemp(prefix="lb-ps-"), "endpoint")

    def start(self) -> None:
        self._port_file.unlink(missing_ok=True)
        args = [sys.executable, "-m", "longboat.ps.server", "--endpoint", self.endpoint,
                "--index", str(self.index), "--servers", str(self.n),
                "--port-file", str(self._port_file)]  # fmt: skip
        if self.checkpoint_dir is not None:
            args += ["--checkpoint-dir", str(self.checkpoint_dir)]
        env = {**os.environ, "LONGBOAT_PS_TOKEN": self.token, **self.env}
        self.proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)  # fmt: skip

    def wait_ready(self, timeout: float = 60) -> None:
        """Block until the server wrote its endpoint; raise with its stderr if it died."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while not self._port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = self.proc.stderr.read().decode() if self.proc.poll() is not None else ""
                self.kill()
                raise RuntimeError(f"server {self.index} did not come up in {timeout}s: {err}")
            time.sleep(0.05)
        self.endpoint = self._port_file.read_text()

    def rss_bytes(self) -> int:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmRSS for server process {self.proc.pid}")

    def kill(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()

    def restart(self) -> None:
        """Kill and start again on the same endpoint (its checkpoint directory restores it)."""
        self.kill()
        self.start()
        self.wait_ready()
