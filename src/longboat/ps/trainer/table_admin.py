"""Trainer-side calls about lazy sparse tables: end a pass (``shrink``) and read their memory
use (``table_stats``). Both go to every server of the current engine (``lb.ps.distribute``).

    lb.ps.shrink()        # at the end of a pass, from one trainer (or all: each call ends one)
    lb.ps.table_stats()   # {server: {table: {"rows", "bytes_per_row", ...}}}
"""

from __future__ import annotations

from typing import Any

from longboat.ps.shared.wire import Message
from longboat.ps.trainer.active_engine import current


def _client() -> Any:
    return current().client


def shrink(tables: list[str] | None = None, client: Any = None) -> dict[str, int]:
    """End a pass of the lazy ``tables`` (default: all) on every server; rows dropped per
    table, summed over the servers. Call it from one trainer, between steps. Without
    ``client``, the current engine's (``PSEngine.shrink``: its replay log keeps the call)."""
    if client is None:
        return current().shrink(tables)
    return shrink_on(client, tables)


def shrink_on(client: Any, tables: list[str] | None) -> dict[str, int]:
    """``shrink`` through ``client``."""
    msgs = {
        s: Message({"shrink": tables if tables is not None else True}) for s in range(len(client))
    }
    total: dict[str, int] = {}
    for reply in client.call_all("configure", msgs).values():
        for name, n in reply.meta["dropped"].items():
            total[name] = total.get(name, 0) + int(n)
    return total


def table_stats(client: Any = None) -> dict[int, dict[str, Any]]:
    """Each server's rows and bytes per row of each table (``LazyRows.stats``)."""
    client = client or _client()
    replies = client.call_all(
        "ping", {s: Message({"table_stats": True}) for s in range(len(client))}
    )
    return {s: r.meta["table_stats"] for s, r in replies.items()}
