"""Hostile callers for the parameter-server tests: a raw HTTP/2 client that opens gRPC calls and
trickles (or never finishes) their bodies, and big requests without a token.

``SlowCalls`` speaks just enough HTTP/2 (RFC 9113) by hand: the preface, SETTINGS/PING acks,
HEADERS as HPACK literals and DATA frames; it records when the server closes each stream.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from longboat.ps.shared.service import SERVICE

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0, 1, 3, 4, 6, 7
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1


def _hpack_int(value: int, prefix_bits: int) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([value])
    out, value = [limit], value - limit
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    return bytes([*out, value])


def _literal(name: str, value: str) -> bytes:
    """One header as an HPACK 'literal without indexing, new name' (no Huffman)."""
    n, v = name.encode(), value.encode()
    return b"\x00" + _hpack_int(len(n), 7) + n + _hpack_int(len(v), 7) + v


class SlowCalls:
    """``count`` calls of ``method`` on one connection to ``endpoint``, without a token, whose
    bodies announce ``announced`` bytes and then arrive one byte per ``trickle_s`` (never
    finishing). ``closed`` maps stream id to the seconds the server took to end the stream."""

    def __init__(
        self,
        endpoint: str,
        count: int,
        *,
        method: str = "push",
        announced: int = 1 << 20,
        trickle_s: float = 0.5,
        metadata: Sequence[tuple[str, str]] = (),
    ) -> None:
        host, _, port = endpoint.rpartition(":")
        self._sock = socket.create_connection((host, int(port)), timeout=10)
        self._sock.settimeout(None)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.opened: dict[int, float] = {}
        self.closed: dict[int, float] = {}
        self.goaway = False
        self._send(_PREFACE)
        self._frame(SETTINGS, 0, 0, b"")
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        fields = {
            ":method": "POST",
            ":scheme": "http",
            ":path": f"/{SERVICE}/{method}",
            ":authority": endpoint,
            "content-type": "application/grpc",
            "te": "trailers",
        }
        headers = b"".join(_literal(k, v) for k, v in [*fields.items(), *metadata])
        for i in range(count):
            sid = 2 * i + 1
            self.opened[sid] = time.monotonic()
            self._frame(HEADERS, END_HEADERS, sid, headers)
            self._frame(DATA, 0, sid, struct.pack(">BI", 0, announced) + b"\0")
        self._trickler = threading.Thread(target=self._trickle, args=(trickle_s,), daemon=True)
        self._trickler.start()

    def _send(self, data: bytes) -> None:
        with self._lock:
            self._sock.sendall(data)

    def _frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        head = struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", kind, flags, stream)
        self._send(head + payload)

    def _recv(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self._sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        return buf

    def _read(self) -> None:
        try:
            while not self._stop.is_set():
                head = self._recv(9)
                length = int.from_bytes(head[:3], "big")
                kind, flags, stream = head[3], head[4], struct.unpack(">I", head[5:])[0]
                payload = self._recv(length)
                if kind == SETTINGS and not flags & ACK:
                    self._frame(SETTINGS, ACK, 0, b"")
                elif kind == PING and not flags & ACK:
                    self._frame(PING, ACK, 0, payload)
                elif kind == GOAWAY:
                    self.goaway = True
                elif stream and (kind == RST_STREAM or flags & END_STREAM):
                    self.closed.setdefault(stream, time.monotonic() - self.opened[stream])
        except OSError:
            self.goaway = True

    def _trickle(self, every: float) -> None:
        while not self._stop.wait(every):
            for sid in self.opened:
                if sid not in self.closed:
                    try:
                        self._frame(DATA, 0, sid, b"\0")
                    except OSError:
                        return

    def wait_closed(self, timeout: float) -> bool:
        """Whether the server ended every stream (or the connection) within ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.goaway or len(self.closed) == len(self.opened):
                return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._reader.join(5)
        self._trickler.join(5)


def big_calls(
    endpoint: str, count: int, nbytes: int, *, method: str = "push", timeout: float = 60
) -> list[tuple[grpc.StatusCode | None, float]]:
    """``count`` concurrent ``nbytes``-byte calls without a token: (status, seconds) of each."""
    payload = bytes(nbytes)
    options = [("grpc.max_send_message_length", nbytes + 1024)]
    with grpc.insecure_channel(endpoint, options=options) as channel:
        stub = channel.unary_unary(f"/{SERVICE}/{method}")

        def one(_: int) -> tuple[grpc.StatusCode | None, float]:
            start = time.monotonic()
            try:
                stub(payload, timeout=timeout)
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
            return code, time.monotonic() - start

        with ThreadPoolExecutor(count) as pool:
            return list(pool.map(one, range(count)))


def memory_kb(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of process ``pid`` in kB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(rest.split()[0])
    return out


class SlowFlood:
    """Keeps ``count`` slow calls open on ``endpoint``: whenever the server ended them all (or
    ``patience`` seconds passed), a new connection opens ``count`` more; ``waves`` counts them
    and ``held`` the waves the server had not ended within ``patience``."""

    def __init__(self, endpoint: str, count: int, patience: float = 10.0) -> None:
        self.endpoint, self.count, self.patience = endpoint, count, patience
        self.waves = self.held = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def wait_waves(self, n: int) -> None:
        """Block until ``n`` waves started; raise what stopped the flood if it died first."""
        while self.waves < n:
            if not self._thread.is_alive():
                raise RuntimeError(f"the flood stopped after {self.waves} waves") from self.error
            time.sleep(0.02)

    def __enter__(self) -> SlowFlood:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(self.patience + 10)

    def _run(self) -> None:
        try:
            self._flood()
        except BaseException as exc:
            self.error = exc
            raise

    def _flood(self) -> None:
        while not self._stop.is_set():
            calls = SlowCalls(self.endpoint, self.count)
            try:
                self.waves += 1
                deadline = time.monotonic() + self.patience
                while not calls.wait_closed(0.1):
                    if self._stop.is_set() or time.monotonic() > deadline:
                        self.held += 1
                        break
            finally:
                calls.close()
            self._stop.wait(0.2)
