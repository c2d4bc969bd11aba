"""What each parameter-server request may carry: one validator per request type.

``parse(method, msg)`` reads a decoded frame into its request (``Init``, ``Push``, ...) and
refuses anything the request cannot carry: unknown fields, wrong types, NaN or infinite
numbers, integers outside their range, tensors of the wrong dtype or shape, tensors a request
does not take. A request's ``check(state)`` then refuses what does not fit what the server
holds (trainers outside the job, unknown blocks and tables, ids outside this server's shard,
values of another shape), under the state's lock; it reads the state through ``ServerView``
(``ServerState`` has it). Both run before anything is applied, so a refused request changes
nothing; each refusal is a ``RequestError`` naming the field (the server answers
INVALID_ARGUMENT). ``ServerState`` and ``Server`` take the parsed requests.

A hello's ``settings`` are opaque: the server keeps the first trainer's and sends them back,
and the trainers compare them (``longboat.ps.trainer.settings``).

The code: ``fields`` (typed reads of the meta), ``specs`` (block and table specs), ``base``
(``Request``, ``ServerView``), ``data`` (``Init``, ``Pull``, ``Push``) and ``control`` (the
other requests).
"""

from __future__ import annotations

from longboat.ps.server.schema.base import MAX_TRAINERS, Request, ServerView
from longboat.ps.server.schema.control import (
    SCOPES,
    Barrier,
    Configure,
    Hello,
    Join,
    Ping,
    Restore,
    Save,
    Stop,
)
from longboat.ps.server.schema.data import Init, Pull, Push
from longboat.ps.server.schema.fields import INT64_MAX, Fields, _finite
from longboat.ps.server.schema.specs import MAX_GROUPS, block_spec, table_spec
from longboat.ps.shared.wire import Message

__all__ = [
    "INT64_MAX",
    "MAX_GROUPS",
    "MAX_TRAINERS",
    "REQUESTS",
    "SCOPES",
    "Barrier",
    "Configure",
    "Fields",
    "Hello",
    "Init",
    "Join",
    "Ping",
    "Pull",
    "Push",
    "Request",
    "Restore",
    "Save",
    "ServerView",
    "Stop",
    "block_spec",
    "parse",
    "table_spec",
]


REQUESTS: dict[str, type[Request]] = {
    r.method: r
    for r in (Init, Push, Pull, Barrier, Ping, Save, Restore, Configure, Stop, Hello, Join)
}


def parse(method: str, msg: Message) -> Request:
    """The request ``msg`` makes of ``method`` (RequestError naming the field if malformed)."""
    _finite(msg.meta, "", skip="settings" if method == "hello" else None)
    return REQUESTS[method].parse(msg)
