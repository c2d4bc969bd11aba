"""Connect-time agreement between a trainer and its servers on every setting that shapes what
they exchange (mode, optimizer and hyper-parameters, sharding, tables, trainer count, ...).

A trainer sends its settings in a ``hello`` call (plain JSON meta of the wire format). Each
server keeps the first trainer's settings of each scope ("engine" for ``lb.ps.distribute``,
"kv" for ``KVClient``) and replies with them, overlaid with its own (index, number of servers,
message limit, wire version). The trainer compares field by field and raises
``SettingsMismatch`` naming the first difference, both values and the fix, so a trainer whose
settings differ from the servers', or from the trainers before it, never trains.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from longboat.ps.shared import wire
from longboat.ps.shared.service import MAX_MESSAGE_ENV
from longboat.ps.shared.wire import Message
from longboat.ps.trainer.client import PSError

OWN = ("wire_version", "num_servers", "server_index", "max_message_bytes")  # the server's own

FIXES = {
    "wire_version": "run the same longboat version on the servers and the trainers",
    "num_servers": "give every trainer the job's full server list (PADDLE_PSERVERS_IP_PORT_LIST "
    "or servers=[...]) and start each server with that count (--servers N)",
    "server_index": "list the servers in the order of their indices (--index or "
    "LONGBOAT_ROLE_RANK): endpoint i must be server i on every trainer",
    "max_message_bytes": f"set {MAX_MESSAGE_ENV} to the same value for the servers and the "
    "trainers",
    "trainers": "start every trainer with the same number of trainers (PADDLE_TRAINERS_NUM or "
    "trainers=)",
    "mode": "give every trainer the same Strategy: a_sync, a_sync_configs['k_steps'] and "
    "use_thread_barrier select sync, async, half_async or geo",
    "k_steps": "set the same a_sync_configs['k_steps'] on every trainer",
    "update_on_server": "set the same a_sync_configs['update_on_server'] on every trainer",
    "optimizer": "build the same optimizer class on every trainer",
    "param_groups": "give every trainer's optimizer the same param groups and hyper-parameters",
    "param_group_of": "put the same parameters into each param group on every trainer",
    "min_block_size": "pass the same min_block_size to lb.ps.distribute on every trainer",
    "max_block_numel": f"set {MAX_MESSAGE_ENV} the same on every trainer",
    "dense_params": "build the same model on every trainer (same parameters)",
    "dense_elements": "build the same model on every trainer (same parameter shapes)",
    "plan": "build the same model on every trainer (same parameter names and shapes, in the "
    "same order)",
    "tables": "define the same SparseEmbedding tables (name, rows, dim, dtype, optimizer, "
    "hyper-parameters, seed, scale) on every trainer",
    "sync": "create every kv client with the same sync= (kvstore: the same store type)",
    "reduce": "create every kv client with the same reduce=",
    "hparams": "give every kv client the same optimizer hyper-parameters",
}


class SettingsMismatch(PSError):
    """A trainer's setting differs from its servers'; ``field``, ``trainer_value`` and
    ``server_value`` say which and how."""

    def __init__(
        self,
        field: str,
        trainer_value: Any,
        server_value: Any,
        *,
        trainer: int,
        server: int,
        endpoint: str,
        set_by: Any,
    ) -> None:
        top = field.split("[", 1)[0].split(".", 1)[0]
        origin = (
            "the server's own setting"
            if top in OWN
            else f"kept from trainer {set_by}, the first to connect"
        )
        fix = FIXES.get(top, "use the same settings on every trainer")
        super().__init__(
            f"trainer {trainer} does not agree with parameter server {server} ({endpoint}) on "
            f"{field}: this trainer has {_shown(trainer_value)}, the server has "
            f"{_shown(server_value)} ({origin}). Fix: {fix}",
            server,
            endpoint,
            "FAILED_PRECONDITION",
        )
        self.field, self.trainer_value, self.server_value = field, trainer_value, server_value


class _Caller(Protocol):
    endpoints: list[str]
    max_bytes: int

    def __len__(self) -> int: ...

    def call_all(self, method: str, msgs: Mapping[int, Message]) -> dict[int, Message]: ...


class _NotSet:
    """The value of a setting one side lacks."""

    def __repr__(self) -> str:
        return "<not set>"


NOT_SET: Any = _NotSet()


def _shown(value: Any) -> str:
    text = repr(value) if value is NOT_SET else json.dumps(value)
    return text if len(text) <= 200 else text[:200] + "..."


def differences(mine: Any, theirs: Any, path: str = "") -> Iterator[tuple[str, Any, Any]]:
    """(path, mine, theirs) wherever JSON values differ, e.g. ``param_groups[0].lr``; a key
    only one side has differs from ``<not set>``."""
    if isinstance(mine, dict) and isinstance(theirs, dict):
        for key in [*mine, *(k for k in theirs if k not in mine)]:
            sub = f"{path}.{key}" if path else str(key)
            a, b = mine.get(key, NOT_SET), theirs.get(key, NOT_SET)
            if a is NOT_SET or b is NOT_SET:
                yield sub, a, b
            else:
                yield from differences(a, b, sub)
    elif isinstance(mine, list) and isinstance(theirs, list) and len(mine) == len(theirs):
        for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            yield from differences(a, b, f"{path}[{i}]")
    elif not _same(mine, theirs):
        yield path, mine, theirs


def _same(a: Any, b: Any) -> bool:
    """Equal JSON values, as a trainer means them: 1 == 1.0, True != 1, NaN == NaN."""
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (a, b))
    if numbers:
        return a == b or (math.isnan(a) and math.isnan(b))
    return type(a) is type(b) and a == b


def agree(caller: _Caller, scope: str, trainer: int, settings: Mapping[str, Any]) -> None:
    """Say hello to every server with ``settings`` (and what this trainer expects of the server
    itself); raise ``SettingsMismatch`` for the first field where a server's differ."""
    mine = json.loads(json.dumps(settings))  # compared as the server keeps them: JSON
    expected = {"wire_version": wire.VERSION, "num_servers": len(caller)}
    expected["max_message_bytes"] = caller.max_bytes
    sent = {s: {**expected, "server_index": s, **mine} for s in range(len(caller))}
    msgs = {
        s: Message({"scope": scope, "trainer": trainer, "settings": own}) for s, own in sent.items()
    }
    replies = caller.call_all("hello", msgs)
    for s in sorted(replies):
        theirs = replies[s].meta.get("settings")
        for field, a, b in differences(sent[s], theirs if isinstance(theirs, dict) else {}):
            raise SettingsMismatch(
                field,
                a,
                b,
                trainer=trainer,
                server=s,
                endpoint=caller.endpoints[s],
                set_by=replies[s].meta.get("set_by"),
            )
