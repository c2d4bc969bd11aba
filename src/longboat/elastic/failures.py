"""Which exceptions mean "a peer is gone" (and call for a new round) rather than a bug."""

from __future__ import annotations

import re

import torch.distributed as dist

#: Words of Gloo/NCCL/TCPStore errors raised when a peer died, hung or became unreachable.
_PEER_SIGNS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out",
    "timeout",
    "socket closed",
    "no route to host",
    "connection refused",
    "ncclremoteerror",
    "ncclsystemerror",
    "process group has been destroyed",
)


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def is_peer_failure(exc: BaseException) -> bool:
    """True when ``exc`` (or what caused it) is a collective or store failing because a peer
    left: torch's DistError family, or a Gloo/NCCL RuntimeError saying so."""
    for e in _chain(exc):
        if isinstance(e, dist.DistError):
            return True
        if isinstance(e, RuntimeError) and any(s in str(e).lower() for s in _PEER_SIGNS):
            return True
    return False


_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*")


def describe(exc: BaseException) -> str:
    """The failure in a few words, for logs and the launcher's console: its first sentence,
    without the C++ source location Gloo puts in front."""
    lines = str(exc).strip().splitlines()
    text = _SOURCE_PREFIX.sub("", lines[0] if lines else "")
    text = text.split(". ")[0].rstrip(".")
    return f"{type(exc).__name__}: {text}"[:200]
