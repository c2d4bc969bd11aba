"""How a server reads a request's meta: typed fields, and the errors a refused request raises."""

from __future__ import annotations

from typing import Any


class RequestError(ValueError):
    """A request that is well-formed on the wire but wrong for this server's state."""


class Closing(RuntimeError):
    """The server is stopping: a call that waited (a sync step, a barrier) ends unanswered."""


class StaleStep(RuntimeError):
    """A sync push or pull for a step this server is not at (e.g. it restarted from a checkpoint)."""


#: a push's meta entry holding a pull's meta: the server answers the push with that pull's reply
PULL_AFTER_PUSH = "pull"

DROPPED = "was dropped from the sync steps"  # in a Dropped refusal's text: the engine rejoins


class Dropped(StaleStep):
    """A sync push from a trainer the server dropped (silent too long) and that has not rejoined
    for that step: refused, never applied."""


def meta_int(meta: dict[str, Any], key: str, default: int) -> int:
    """``meta[key]`` as an int (``default`` if absent); RequestError for anything else."""
    value = meta.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestError(f"{key!r} must be an integer, got {value!r}")
    return value


def meta_list(meta: dict[str, Any], key: str) -> list[Any]:
    """``meta[key]`` as a list (empty if absent); RequestError for anything else."""
    value = meta.get(key) or []
    if not isinstance(value, list):
        raise RequestError(f"{key!r} must be a list")
    return value
