"""Parameter servers as objects of this process: the same ``ServerState`` code that a gRPC server
runs, called directly (no sockets, no token). ``KVClient`` talks to it like to a ``Client``;
``longboat.kvstore``'s "local" and "device" stores use it, so they update values with exactly the
arithmetic of the distributed ones."""

from __future__ import annotations

import time
from collections.abc import Mapping

from longboat.ps.server.state import ServerState
from longboat.ps.shared import wire
from longboat.ps.shared.service import default_timeout, max_message_bytes
from longboat.ps.shared.wire import Message

_CALLS = ("init", "push", "pull", "barrier", "configure", "hello")


class LocalServers:
    """``n`` in-process server states answering ``call_all`` like ``Client`` does."""

    def __init__(self, n: int = 1) -> None:
        self.states = [ServerState(i, n) for i in range(n)]
        self.endpoints = [f"in-process:{i}" for i in range(n)]
        self.timeout = default_timeout()
        self.max_bytes = max_message_bytes()

    def __len__(self) -> int:
        return len(self.states)

    def connect(self, timeout: float | None = None) -> None:
        """Nothing to connect to."""

    def start(
        self, server: int, method: str, msg: Message, timeout: float | None = None
    ) -> _Answered:
        """Answer ``msg`` now; ``result()`` of the returned object gives the reply."""
        return _Answered(self.call_all(method, {server: msg}, timeout)[server])

    def call_all(
        self, method: str, msgs: Mapping[int, Message], timeout: float | None = None
    ) -> dict[int, Message]:
        if method not in _CALLS:
            raise ValueError(f"in-process servers answer {_CALLS}, not {method!r}")
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        out = {}
        for server, msg in msgs.items():
            state = self.states[server]
            if method == "pull":
                out[server] = wire.decode(state.pull(msg, deadline), self.max_bytes)
            elif method == "barrier":
                out[server] = state.barrier(msg, deadline)
            elif method == "hello":
                own = {"wire_version": wire.VERSION, "max_message_bytes": self.max_bytes}
                out[server] = state.hello(msg, own)
            else:
                out[server] = getattr(state, method)(msg)
        return out

    def close(self) -> None:
        """Nothing to close."""


class _Answered:
    """A reply already at hand, shaped like a ``Call`` in flight."""

    def __init__(self, reply: Message) -> None:
        self._reply = reply

    def result(self) -> Message:
        return self._reply
