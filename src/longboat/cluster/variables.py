"""longboat's own ``LONGBOAT_*`` variables (Strategy fields aside, which the Strategy parses).

`VARIABLES` holds the parser of every one longboat reads: `variable` reads one, `check_variables`
checks all that are set, as ``longboat launch`` does before any rank starts.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from longboat.cluster.info import ClusterError


@dataclass(frozen=True)
class Variable:
    """A ``LONGBOAT_*`` variable: what it accepts (for messages) and its parser, which raises
    ValueError for a value outside that."""

    name: str
    accepts: str | Callable[[], str]  # a callable: when it depends on the torch build
    parse: Callable[[str], Any]
    by_launcher: bool = False  # `longboat launch` sets it for its ranks


def _number(kind: Callable[[str], float], low: float, above: bool) -> Callable[[str], Any]:
    """A parser of finite ``kind`` numbers >= ``low`` (> ``low`` with ``above``)."""

    def parse(text: str) -> Any:
        value = kind(text.strip())
        if not math.isfinite(value) or value < low or (above and value == low):
            raise ValueError(text)
        return value

    return parse


_seconds = _number(float, 0, above=True)
_seconds_or_zero = _number(float, 0, above=False)
_count = _number(int, 0, above=False)
_positive_count = _number(int, 1, above=False)
SECONDS = "a positive number of seconds, e.g. 300"
COUNT = "a whole number >= 0"
POSITIVE_COUNT = "a whole number >= 1"
TEXT = "any text"


def _backend(text: str) -> str:
    import torch.distributed as dist

    name = text.strip().lower()
    if not dist.is_available() or not dist.is_backend_available(name):
        raise ValueError(text)
    return name


def _backends() -> str:
    """What LONGBOAT_BACKEND accepts in this torch build."""
    import torch.distributed as dist

    if not dist.is_available():
        return "a torch.distributed backend (this torch build has none)"
    names = [b for b in ("gloo", "nccl", "mpi", "ucc", "xccl") if dist.is_backend_available(b)]
    return "a process-group backend this torch build has: " + " or ".join(names)


def _log_level(text: str) -> str:
    name = text.strip().upper()
    if name not in logging.getLevelNamesMapping():
        raise ValueError(text)
    return name


def _role(text: str) -> str:
    if text not in ("server", "trainer"):
        raise ValueError(text)
    return text


def _port_number(text: str) -> int:
    port = int(text.strip())
    if not 0 < port < 65536:
        raise ValueError(text)
    return port


def _ports(text: str) -> list[int]:
    return [_port_number(item) for item in text.split(",")]


def _endpoints(text: str) -> list[str]:
    items = [item.strip() for item in text.split(",")]
    for item in items:
        host, sep, port = item.rpartition(":")
        if not (sep and host):
            raise ValueError(text)
        _port_number(port)
    return items


def _devices(text: str) -> list[str]:
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise ValueError(text)
    return items


def _file(text: str) -> str:
    if not os.path.isfile(text):
        raise ValueError(text)
    return text


def _directory(text: str) -> str:
    if not os.path.isdir(text):
        raise ValueError(text)
    return text


def _directory_to_be(text: str) -> str:
    if os.path.exists(text) and not os.path.isdir(text):
        raise ValueError(text)
    return text


VARIABLES: dict[str, Variable] = {
    v.name: v
    for v in (
        Variable("LONGBOAT_TIMEOUT", SECONDS, _seconds),
        Variable("LONGBOAT_BACKEND", _backends, _backend),
        Variable("LONGBOAT_LOG_LEVEL", "DEBUG, INFO, WARNING, ERROR or CRITICAL", _log_level),
        Variable("LONGBOAT_RUN_ID", TEXT, str),
        Variable("LONGBOAT_SHM_DIR", "an existing directory, e.g. a tmpfs", _directory),
        Variable("LONGBOAT_CONFIG", "an existing Strategy YAML or JSON file", _file),
        Variable("LONGBOAT_PS_TOKEN", TEXT, str),
        Variable("LONGBOAT_PS_TOKEN_FILE", "an existing file holding the job's token", _file),
        Variable("LONGBOAT_PS_TIMEOUT", "a positive number of seconds, e.g. 120", _seconds),
        Variable("LONGBOAT_PS_MAX_MESSAGE_MB", "a positive number of MB", _number(float, 0, True)),
        Variable("LONGBOAT_PS_MAX_CALLS", POSITIVE_COUNT, _positive_count),
        Variable("LONGBOAT_PS_MAX_STREAMS", POSITIVE_COUNT, _positive_count),
        Variable("LONGBOAT_PS_MAX_CONNECTIONS", POSITIVE_COUNT, _positive_count),
        Variable("LONGBOAT_PS_BODY_TIMEOUT", SECONDS, _seconds),
        Variable("LONGBOAT_PS_TRAINER_TIMEOUT", SECONDS, _seconds),
        Variable("LONGBOAT_PS_RESTART_WAIT", "a number of seconds >= 0", _seconds_or_zero),
        Variable("LONGBOAT_PS_CHECKPOINT_DIR", "a directory (made if missing)", _directory_to_be),
        Variable("LONGBOAT_PS_CHECKPOINT_EVERY", "a whole number of steps >= 0", _count),
        # set by `longboat launch` for its ranks
        Variable("LONGBOAT_LAUNCH_TIMEOUT", SECONDS, _seconds, by_launcher=True),
        Variable("LONGBOAT_NNODES", POSITIVE_COUNT, _positive_count, by_launcher=True),
        Variable("LONGBOAT_NODE_RANK", COUNT, _count, by_launcher=True),
        Variable("LONGBOAT_NUM_SERVERS", COUNT, _count, by_launcher=True),
        Variable("LONGBOAT_LOCAL_SERVERS", COUNT, _count, by_launcher=True),
        Variable("LONGBOAT_ROLE", "'server' or 'trainer'", _role, by_launcher=True),
        Variable("LONGBOAT_ROLE_RANK", COUNT, _count, by_launcher=True),
        Variable("LONGBOAT_HOST_IP", TEXT, str, by_launcher=True),
        Variable(
            "LONGBOAT_ENDPOINT_PORTS", "a comma-separated list of ports", _ports, by_launcher=True
        ),
        Variable(
            "LONGBOAT_ALL_ENDPOINTS",
            "a comma-separated list of host:port",
            _endpoints,
            by_launcher=True,
        ),
        Variable(
            "LONGBOAT_DEVICES", "a comma-separated list of device ids", _devices, by_launcher=True
        ),
        Variable("LONGBOAT_LOG_DIR", TEXT, str, by_launcher=True),
        Variable("LONGBOAT_LOG_FILE", TEXT, str, by_launcher=True),
        Variable("LONGBOAT_ELASTIC_DIR", TEXT, str, by_launcher=True),
        Variable("LONGBOAT_ELASTIC_COPY_DIR", TEXT, str, by_launcher=True),
        Variable("LONGBOAT_EMULATE_BANDWIDTH", TEXT, str, by_launcher=True),
        Variable("LONGBOAT_EMULATE_LATENCY", TEXT, str, by_launcher=True),
    )
}
"""Every ``LONGBOAT_*`` variable longboat reads that is not a Strategy field, by name."""


def variable(name: str, env: Mapping[str, str] | None = None, default: Any = None) -> Any:
    """The parsed value of ``LONGBOAT_*`` variable ``name`` in ``env`` (default ``os.environ``);
    ``default`` when it is unset or blank. ClusterError naming the variable, its value and
    what it accepts when the value is malformed."""
    env = os.environ if env is None else env
    var = VARIABLES[name]
    text = env.get(name)
    if text is None or not text.strip():
        return default
    try:
        return var.parse(text)
    except ValueError:
        accepts = var.accepts if isinstance(var.accepts, str) else var.accepts()
        raise ClusterError(f"{name}={text!r} is not {accepts}; fix or unset it") from None


def check_variables(
    env: Mapping[str, str] | None = None, skip: frozenset[str] = frozenset()
) -> None:
    """Parse every `VARIABLES` entry set in ``env`` (but those in ``skip``); ClusterError for the
    first malformed one, in name order."""
    env = os.environ if env is None else env
    for name in sorted(set(env) & set(VARIABLES) - skip):
        variable(name, env)
