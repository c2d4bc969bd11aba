"""What one parameter server lets its callers hold, read from ``LONGBOAT_PS_*`` variables.

Operators change the variable; everything else here is fixed and documented in docs/ps.md
("Security and limits"). ``ServerLimits.grpc_options`` turns the limits into gRPC server
options (HTTP/2 settings, keepalive and ping policing, message and metadata sizes).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

MAX_CALLS_ENV = "LONGBOAT_PS_MAX_CALLS"
MAX_STREAMS_ENV = "LONGBOAT_PS_MAX_STREAMS"
MAX_CONNECTIONS_ENV = "LONGBOAT_PS_MAX_CONNECTIONS"
BODY_TIMEOUT_ENV = "LONGBOAT_PS_BODY_TIMEOUT"
TRAINER_TIMEOUT_ENV = "LONGBOAT_PS_TRAINER_TIMEOUT"

KEEPALIVE_S = 60  # the server pings a connection with calls this often, to find dead peers
KEEPALIVE_TIMEOUT_S = 20  # ... and closes it when the ping is not answered within this
MIN_CLIENT_PING_S = 10  # client pings closer than this without data are strikes (without
MAX_PING_STRIKES = 2  # calls: closer than 2 hours); one more than this ends the connection
IDLE_S = 600  # a connection without calls for this long is closed (clients reconnect)
HANDSHAKE_S = 20  # a connection must complete its HTTP/2 handshake within this
MAX_METADATA_BYTES = 16 << 10  # request headers (the token is 43 bytes)

ENV = {
    "max_calls": MAX_CALLS_ENV,
    "max_streams": MAX_STREAMS_ENV,
    "max_connections": MAX_CONNECTIONS_ENV,
    "body_timeout_s": BODY_TIMEOUT_ENV,
    "trainer_timeout_s": TRAINER_TIMEOUT_ENV,
}


@dataclass(frozen=True)
class ServerLimits:
    """Per-server bounds on what callers hold; ``from_env`` reads the operator's settings."""

    max_calls: int = 256  # calls in progress on the server, each with its worker thread
    max_streams: int = 128  # calls in progress on one connection (HTTP/2 MAX_CONCURRENT_STREAMS)
    max_connections: int = 1024  # open connections to the server
    body_timeout_s: float = 60.0  # seconds from a call's start until its request has arrived
    # seconds a trainer that a sync step or barrier waits for may stay silent before the
    # server drops it from the steps (docs/ps.md, "When a trainer dies")
    trainer_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for f in fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"{ENV[f.name]} must be positive, got {getattr(self, f.name)!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ServerLimits:
        env = os.environ if env is None else env
        values: dict[str, Any] = {}  # an int or a float, as the field's type says
        for f in fields(cls):
            raw = env.get(ENV[f.name])
            if raw:
                try:
                    values[f.name] = float(raw) if f.type == "float" else int(raw)
                except ValueError:
                    raise ValueError(f"{ENV[f.name]}={raw!r} is not a {f.type}") from None
        return cls(**values)

    def grpc_options(self, max_bytes: int) -> list[tuple[str, int]]:
        """gRPC server options for these limits and ``max_bytes`` per message."""
        return [
            ("grpc.max_send_message_length", max_bytes),
            ("grpc.max_receive_message_length", max_bytes),
            ("grpc.max_concurrent_streams", self.max_streams),
            ("grpc.max_allowed_incoming_connections", self.max_connections),
            ("grpc.max_metadata_size", MAX_METADATA_BYTES),
            ("grpc.absolute_max_metadata_size", MAX_METADATA_BYTES),
            ("grpc.keepalive_time_ms", KEEPALIVE_S * 1000),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_S * 1000),
            ("grpc.keepalive_permit_without_calls", 0),
            ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_S * 1000),
            ("grpc.http2.max_ping_strikes", MAX_PING_STRIKES),
            ("grpc.max_connection_idle_ms", IDLE_S * 1000),
            ("grpc.server_handshake_timeout_ms", HANDSHAKE_S * 1000),
        ]
