"""A trainer's connections to every server: authenticated, size-bounded calls with deadlines,
issued in parallel (futures), with every failure naming the server and endpoint."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence

import grpc

from longboat.ps import auth, wire
from longboat.ps.wire import Message

SERVICE = "longboat.ps.ParameterServer"
METHODS = ("init", "push", "pull", "barrier", "ping", "save", "restore")
DEFAULT_TIMEOUT_S = 120.0
DEFAULT_MAX_MESSAGE_MB = 256
TIMEOUT_ENV = "LONGBOAT_PS_TIMEOUT"
MAX_MESSAGE_ENV = "LONGBOAT_PS_MAX_MESSAGE_MB"


class PSError(RuntimeError):
    """A call to a parameter server failed; ``server`` and ``endpoint`` say which one."""

    def __init__(self, message: str, server: int = -1, endpoint: str = "", code: str = ""):
        super().__init__(message)
        self.server, self.endpoint, self.code = server, endpoint, code


def default_timeout() -> float:
    return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


def max_message_bytes() -> int:
    return int(float(os.environ.get(MAX_MESSAGE_ENV, DEFAULT_MAX_MESSAGE_MB)) * (1 << 20))


def channel_options(max_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_bytes),
        ("grpc.max_receive_message_length", max_bytes),
        ("grpc.enable_http_proxy", 0),
    ]


class Call:
    """One call in flight; ``result()`` decodes the reply or raises PSError naming the server."""

    def __init__(self, future: grpc.Future, server: int, endpoint: str, method: str) -> None:
        self._future, self.server, self.endpoint, self.method = future, server, endpoint, method

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> Message:
        try:
            raw = self._future.result()
        except grpc.RpcError as exc:
            code = exc.code()
            raise PSError(
                f"parameter server {self.server} ({self.endpoint}) failed {self.method}: "
                f"{code.name if code else '?'}: {exc.details()}",
                self.server,
                self.endpoint,
                code.name if code else "",
            ) from None
        return wire.decode(raw)


class Client:
    """Channels to ``endpoints`` (server i at endpoints[i]) carrying ``token``."""

    def __init__(
        self,
        endpoints: Sequence[str],
        token: str,
        *,
        timeout: float | None = None,
        max_bytes: int | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("no parameter-server endpoints given")
        self.endpoints = list(endpoints)
        self.timeout = default_timeout() if timeout is None else timeout
        self.max_bytes = max_bytes or max_message_bytes()
        self._metadata = ((auth.METADATA_KEY, token),)
        self._channels = [
            grpc.insecure_channel(e, options=channel_options(self.max_bytes)) for e in endpoints
        ]
        self._stubs = [
            {m: ch.unary_unary(f"/{SERVICE}/{m}") for m in METHODS} for ch in self._channels
        ]

    def __len__(self) -> int:
        return len(self.endpoints)

    def connect(self, timeout: float | None = None) -> None:
        """Wait (bounded) until every server accepts connections; name the first that does not."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        for i, channel in enumerate(self._channels):
            try:
                grpc.channel_ready_future(channel).result(max(0.0, deadline - time.monotonic()))
            except grpc.FutureTimeoutError:
                raise PSError(
                    f"parameter server {i} at {self.endpoints[i]} did not answer within "
                    f"{self.timeout if timeout is None else timeout:.0f}s; is it running "
                    "(longboat launch --servers N, or lb.ps.run_server()) and reachable?",
                    i,
                    self.endpoints[i],
                    "UNAVAILABLE",
                ) from None

    def start(self, server: int, method: str, msg: Message, timeout: float | None = None) -> Call:
        """Send ``msg`` to ``server`` without waiting."""
        frame = wire.encode(msg)
        if len(frame) > self.max_bytes:
            raise PSError(
                f"{method} to parameter server {server} would be {len(frame)} bytes, above "
                f"the {self.max_bytes}-byte limit ({MAX_MESSAGE_ENV})",
                server,
                self.endpoints[server],
            )
        future = self._stubs[server][method].future(
            frame, timeout=self.timeout if timeout is None else timeout, metadata=self._metadata
        )
        return Call(future, server, self.endpoints[server], method)

    def call(self, server: int, method: str, msg: Message, timeout: float | None = None) -> Message:
        return self.start(server, method, msg, timeout).result()

    def call_all(
        self, method: str, msgs: Mapping[int, Message], timeout: float | None = None
    ) -> dict[int, Message]:
        """The same method on several servers in parallel; every reply, or the first error."""
        calls = {s: self.start(s, method, m, timeout) for s, m in msgs.items()}
        return {s: c.result() for s, c in calls.items()}

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
