"""Parameter-server mode: sharded servers over gRPC; sync, async, half-async and geo updates.

    import longboat as lb
    strategy = lb.Strategy(mode="ps", a_sync=False)           # sync; see docs/ps.md
    model, optimizer = lb.distribute(model, optimizer, strategy)  # in a trainer
    lb.ps.run_server()                                        # in a server rank
    lb.ps.save()                                              # checkpoint every server

Names are imported on first use (the server needs no trainer code and vice versa).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

_EXPORTS: dict[str, str] = {
    "run_server": "longboat.ps.server.rpc",
    "Server": "longboat.ps.server.rpc",
    "SparseEmbedding": "longboat.ps.sparse",
    "distribute": "longboat.ps.engine",
    "save": "longboat.ps.engine",
    "shrink": "longboat.ps.table_admin",
    "table_stats": "longboat.ps.table_admin",
    "current": "longboat.ps.engine",
    "PSConfig": "longboat.ps.engine",
    "PSError": "longboat.ps.client",
    "SettingsMismatch": "longboat.ps.settings",
    "ServerLimits": "longboat.ps.server.limits",
    "Client": "longboat.ps.client",
    "KVClient": "longboat.ps.kv",
    "make_plan": "longboat.ps.plan",
    "generate_token": "longboat.ps.shared.auth",
}

__all__ = sorted(_EXPORTS)
ps = sys.modules[__name__]  # so that `lb.ps` resolves through longboat's lazy exports


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'longboat.ps' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
