"""What a caller may cost a parameter server before it proves itself, and how long it may take.

``TokenGate`` (a ``grpc.ServerInterceptor``) checks the job token in a call's metadata when
the call starts, in gRPC's dispatch, before any of the request body is read. A call without
it is answered UNAUTHENTICATED by a request-streaming handler that never asks for a message:
gRPC then sends the status at once and drops the body, and the worker is free within
microseconds. (A unary-request handler would first wait for, and buffer, the whole body.)

``first_message`` bounds the wait for an authenticated call's body (``Alarms`` cancels the call
when it is late), so a slow or stuck sender cannot hold a worker for longer than that.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from longboat.log import get_logger
from longboat.ps.server import limits
from longboat.ps.shared import auth

log = get_logger("longboat.ps")

REPORT_EVERY_S = 60.0


class TokenGate(grpc.ServerInterceptor):
    """Let through calls carrying ``token``; end every other one at once with UNAUTHENTICATED
    (``details`` tells the caller how to set the token). Refusals are logged, at most once
    per ``REPORT_EVERY_S``, with their count and latest peer."""

    def __init__(self, token: str, details: str, name: str = "parameter server") -> None:
        if not token:
            raise ValueError("a token gate needs a non-empty token")
        self._token, self._details, self._name = token, details, name
        self._lock = threading.Lock()
        self.refused = 0
        self._reported, self._last_report = 0, 0.0
        self._refuse = grpc.stream_unary_rpc_method_handler(self._abort)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        metadata = handler_call_details.invocation_metadata
        if auth.check(metadata, self._token):
            return continuation(handler_call_details)
        return self._refuse

    def _abort(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        """Never iterates ``requests``: no receive is started, the body is never read."""
        with self._lock:
            self.refused += 1
            now = time.monotonic()
            unreported = self.refused - self._reported
            if now - self._last_report >= REPORT_EVERY_S:
                self._reported, self._last_report = self.refused, now
            else:
                unreported = 0
        if unreported:
            log.warning(
                "%s refused %d call(s) without this job's token, the latest from %s (another "
                "job, a scanner, or a trainer given the wrong token)",
                self._name,
                unreported,
                context.peer(),
            )
        context.abort(grpc.StatusCode.UNAUTHENTICATED, self._details)
        raise AssertionError("unreachable")


class Alarms:
    """``fn()`` at monotonic time ``when`` unless cancelled first; one thread for all alarms."""

    def __init__(self) -> None:
        self._heap: list[list[Any]] = []
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._cancelled = 0
        self._closed = False
        self._thread: threading.Thread | None = None

    def arm(self, when: float, fn: Callable[[], None]) -> list[Any]:
        """Schedule ``fn``; pass the returned handle to ``cancel``."""
        entry = [when, next(self._seq), fn]
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lb-ps-alarms", daemon=True)
                self._thread.start()
            heapq.heappush(self._heap, entry)
            if self._heap[0] is entry:
                self._cond.notify()
        return entry

    def cancel(self, entry: list[Any]) -> None:
        with self._cond:
            if entry[2] is not None:
                entry[2] = None
                self._cancelled += 1
                if self._cancelled > 64 and self._cancelled * 2 > len(self._heap):
                    self._heap = [e for e in self._heap if e[2] is not None]
                    heapq.heapify(self._heap)
                    self._cancelled = 0

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    wait = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._cond.wait(wait)
                if self._closed:
                    return
                entry = heapq.heappop(self._heap)
                fn, entry[2] = entry[2], None
                if fn is None:
                    self._cancelled -= 1
            if fn is not None:
                try:
                    fn()
                except Exception:  # an alarm that fails must not stop the others
                    log.exception("parameter-server alarm failed")


def first_message(
    requests: Iterator[bytes], context: grpc.ServicerContext, alarms: Alarms, timeout: float
) -> bytes | None:
    """The call's request (None if it has none), or the call is cancelled once ``timeout``
    seconds pass without it (the caller then sees CANCELLED and this raises grpc.RpcError)."""
    late = alarms.arm(time.monotonic() + timeout, lambda: _late(context, timeout))
    try:
        return next(requests, None)
    finally:
        alarms.cancel(late)


def _late(context: grpc.ServicerContext, timeout: float) -> None:
    log.warning(
        "cancelled a parameter-server call from %s: its request did not arrive within "
        "%.0f s of its start (%s)",
        context.peer(),
        timeout,
        limits.BODY_TIMEOUT_ENV,
    )
    context.cancel()
