"""A trainer's connections to every server: authenticated, size-bounded calls with deadlines,
issued in parallel (futures), with every failure naming the server and endpoint.

Two optional collaborators, given at construction and None unless ``lb.ps.distribute``'s
strategy asks for them (a None check each otherwise): ``stall`` (`ReplyWatch`,
``stall_warning_seconds``) makes a wait for a reply warn, and eventually exit, when the server
takes too long; ``observer`` (the timeline's ``PSObserver``) records every call on the trace's
``ps`` lane.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc

from longboat.ps.shared import auth, wire
from longboat.ps.shared.request import PULL_AFTER_PUSH
from longboat.ps.shared.service import (
    MAX_MESSAGE_ENV,
    METHODS,
    SERVICE,
    default_timeout,
    max_message_bytes,
)
from longboat.ps.shared.wire import Message
from longboat.trace import stall as _stall


class PSError(RuntimeError):
    """A call to a parameter server failed; ``server`` and ``endpoint`` say which one."""

    def __init__(self, message: str, server: int = -1, endpoint: str = "", code: str = ""):
        super().__init__(message)
        self.server, self.endpoint, self.code = server, endpoint, code


def channel_options(max_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_bytes),
        ("grpc.max_receive_message_length", max_bytes),
        ("grpc.enable_http_proxy", 0),
        # a restarted server is found again within about a second, not after gRPC's
        # exponential back-off (up to two minutes)
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


class ReplyWatch:
    """Stall inspection of server replies (``stall_warning_seconds`` / ``stall_shutdown_seconds``).

    A trainer blocked in ``Call.result()`` polls the reply with a timeout: once the call has
    been out ``warning_s`` seconds it logs ``explain(call, waited)`` (repeated every
    ``warning_s``), and at ``shutdown_s`` (0: never) it logs it as an error and exits with
    ``STALL_EXIT_CODE``. The client's own deadline (``timeout``) still ends the call.
    """

    def __init__(
        self,
        warning_s: float,
        shutdown_s: float = 0.0,
        explain: Callable[[Call, float], str] | None = None,
        exit_fn: Callable[[int], None] = os._exit,
    ) -> None:
        self.warning_s, self.shutdown_s = warning_s, shutdown_s
        self.explain = explain or _explain
        self.exit_fn = exit_fn

    def wait(self, call: Call) -> bytes:
        """The reply's bytes, warning (and shutting down) while it is late."""
        future = call._future
        next_warning = self.warning_s
        while True:
            waited = time.monotonic() - call.sent
            if self.shutdown_s > 0 and waited >= self.shutdown_s:
                _stall.abort(self.explain(call, waited), self.shutdown_s, self.exit_fn)
                raise PSError(
                    f"stall shutdown: {call.method} to parameter server {call.server} unanswered "
                    f"after {waited:.1f} s",
                    call.server,
                    call.endpoint,
                    "DEADLINE_EXCEEDED",
                )
            if waited >= next_warning:
                next_warning = waited + self.warning_s
                _stall.log.warning(
                    "%s. Fix the slow or stuck trainer or server (its log shows where it is); "
                    "raise stall_warning_seconds if such waits are expected",
                    self.explain(call, waited),
                )
            until = next_warning if self.shutdown_s <= 0 else min(next_warning, self.shutdown_s)
            try:
                return future.result(timeout=max(0.01, until - waited))
            except grpc.FutureTimeoutError:
                continue


def _explain(call: Call, waited: float) -> str:
    return (
        f"parameter server {call.server} ({call.endpoint}) has not answered {call.method} for "
        f"keys [{_stall.shown(call.keys())}] after {waited:.1f} s"
    )


class Call:
    """One call in flight; ``result()`` decodes the reply or raises PSError naming the server."""

    def __init__(
        self,
        future: grpc.Future,
        server: int,
        endpoint: str,
        method: str,
        msg: Message | None = None,
        stall: ReplyWatch | None = None,
    ) -> None:
        self._future, self.server, self.endpoint, self.method = future, server, endpoint, method
        self.msg, self._stall = msg, stall
        self.sent = time.monotonic() if stall is not None else 0.0

    def done(self) -> bool:
        return self._future.done()

    def waits_as(self) -> tuple[str, dict[str, Any]]:
        """What this call waits on, as (method, meta): a push carrying the step's pull (its
        reply is that pull's) waits as that pull."""
        meta = self.msg.meta if self.msg is not None else {}
        then = meta.get(PULL_AFTER_PUSH)
        if self.method == "push" and isinstance(then, dict):
            return "pull", then
        return self.method, meta

    def keys(self) -> list[str]:
        """The blocks (and sparse tables) this call carries or asks for."""
        if self.msg is None:
            return []
        meta = self.msg.meta
        keys = [str(k) for k in meta.get("keys") or []]
        keys += [str(b.get("key")) for b in meta.get("blocks") or [] if isinstance(b, dict)]
        for name, t in self.msg.tensors.items():
            if name.endswith("@ids"):
                keys.append(f"{name[:-4]} ({t.numel()} rows)")
            elif not name.endswith("@grad"):
                keys.append(name)
        return keys

    def result(self) -> Message:
        try:
            raw = self._future.result() if self._stall is None else self._stall.wait(self)
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
        stall: ReplyWatch | None = None,
        observer: Any = None,
    ) -> None:
        """``stall`` inspects late replies; ``observer`` (a ``PSObserver``) records every call."""
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
        self.stall = stall
        self.observer = observer

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

    def start(
        self,
        server: int,
        method: str,
        msg: Message,
        timeout: float | None = None,
        watched: bool = True,
    ) -> Call:
        """Send ``msg`` to ``server`` without waiting (``watched=False``: neither the stall
        inspection nor the timeline sees the call, e.g. the stall inspection's own questions)."""
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
        call = Call(future, server, self.endpoints[server], method, msg,
                    self.stall if watched else None)  # fmt: skip
        if self.observer is not None and watched:
            self.observer.started(call, len(frame))
        return call

    def call(self, server: int, method: str, msg: Message, timeout: float | None = None) -> Message:
        return self.start(server, method, msg, timeout).result()

    def call_all(
        self, method: str, msgs: Mapping[int, Message], timeout: float | None = None
    ) -> dict[int, Message]:
        """The same method on several servers in parallel; every reply, or the first error."""
        calls = {s: self.start(s, method, m, timeout) for s, m in msgs.items()}
        return {s: c.result() for s, c in calls.items()}

    def waiting_for(self, server: int, question: dict[str, Any]) -> list[Any]:
        """The trainers ``server`` says a stalled call still waits for (``question``: the call's
        ``keys``/``tables``/``version`` or ``barrier``); [] when it cannot say within 2 s."""
        try:
            reply = self.start(server, "ping", Message(question), 2.0, False).result()
        except PSError:
            return []
        lacking = reply.meta.get("waiting_for")
        return lacking if isinstance(lacking, list) else []

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
