"""The gRPC service both processes speak: its name, its methods, the message size limit and the
call deadline (``LONGBOAT_PS_MAX_MESSAGE_MB``, ``LONGBOAT_PS_TIMEOUT``), read the same way by a
server and by its trainers."""

from __future__ import annotations

import os

SERVICE = "longboat.ps.ParameterServer"
METHODS = (
    "init",
    "push",
    "pull",
    "barrier",
    "ping",
    "save",
    "restore",
    "configure",
    "stop",
    "hello",
    "join",
)
DEFAULT_TIMEOUT_S = 120.0
DEFAULT_MAX_MESSAGE_MB = 256
TIMEOUT_ENV = "LONGBOAT_PS_TIMEOUT"
MAX_MESSAGE_ENV = "LONGBOAT_PS_MAX_MESSAGE_MB"


def default_timeout() -> float:
    return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


def max_message_bytes() -> int:
    return int(float(os.environ.get(MAX_MESSAGE_ENV, DEFAULT_MAX_MESSAGE_MB)) * (1 << 20))
