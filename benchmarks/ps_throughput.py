"""Parameter-server push+pull throughput next to raw loopback TCP, measured in the same run.

    python benchmarks/ps_throughput.py --sizes 4 16 64 256 --repeat 5

For each size S (MB of float32 parameters) one trainer pushes S bytes to two server processes
(split into blocks, half per server, sent in parallel) and pulls S bytes back; the raw TCP
baseline sends the same S bytes to an echo process over one loopback socket and reads them back.
Both report (bytes pushed + bytes pulled) / seconds, the median of ``--repeat`` rounds.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from longboat.ps.shared.auth import generate_token
from longboat.ps.trainer.kv import KVClient


def echo(port_file: str) -> None:
    """The TCP baseline's other end: read a length-prefixed message, send it back."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        Path(port_file).write_text(str(srv.getsockname()[1]))
        conn, _ = srv.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while header := _recv(conn, 8):
                conn.sendall(_recv(conn, struct.unpack("<Q", header)[0]))


def _recv(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:], n - got)
        if k == 0:
            return b""
        got += k
    return bytes(buf)


def _start(args: list[str], port_file: Path, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, *args], env={**os.environ, **env})
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{args} did not start within 60s")
        time.sleep(0.05)
    time.sleep(0.05)
    return proc, port_file.read_text()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=float, nargs="+", default=[4, 16, 64, 256], help="MB")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--echo", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.echo:
        echo(a.echo)
        return
    torch.set_num_threads(1)
    token = generate_token()
    env = {"LONGBOAT_PS_TOKEN": token, "LONGBOAT_PS_MAX_MESSAGE_MB": "512", "OMP_NUM_THREADS": "1"}
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            endpoints = []
            for i in range(2):
                f = Path(tmp, f"server{i}")
                proc, ep = _start(["-m", "longboat.ps.server", "--index", str(i), "--servers",
                                   "2", "--port-file", str(f)], f, env)  # fmt: skip
                procs.append(proc)
                endpoints.append(ep)
            proc, port = _start([__file__, "--echo", str(Path(tmp, "echo"))], Path(tmp, "echo"), {})
            procs.append(proc)
            sock = socket.create_connection(("127.0.0.1", int(port)))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            os.environ["LONGBOAT_PS_MAX_MESSAGE_MB"] = "512"
            kv = KVClient(endpoints, token, timeout=300)
            print(
                f"{'MB':>6} {'ps GB/s':>9} {'tcp GB/s':>9} {'ps/tcp':>7}   (median of "
                f"{a.repeat}; push+pull bytes / s; 2 server processes, 1 trainer)"
            )
            for mb in a.sizes:
                n = int(mb * (1 << 20)) // 4
                value = torch.randn(n // 1024, 1024)
                payload = value.numpy().tobytes()
                kv.init(f"p{mb}", value)
                ps_t, tcp_t = [], []
                for _ in range(a.repeat + 1):  # the first round warms up
                    t0 = time.perf_counter()
                    kv.push(f"p{mb}", value)
                    kv.pull(f"p{mb}")
                    ps_t.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    sock.sendall(struct.pack("<Q", len(payload)))
                    sock.sendall(payload)
                    _recv(sock, len(payload))
                    tcp_t.append(time.perf_counter() - t0)
                moved = 2 * value.numel() * 4 / 1e9
                ps_gbs = moved / statistics.median(ps_t[1:])
                tcp_gbs = moved / statistics.median(tcp_t[1:])
                print(f"{mb:>6g} {ps_gbs:>9.2f} {tcp_gbs:>9.2f} {ps_gbs / tcp_gbs:>7.2f}",
                      flush=True)  # fmt: skip
            sock.close()
            kv.close()
        finally:
            for proc in procs:
                proc.kill()
                proc.wait(10)


if __name__ == "__main__":
    main()
