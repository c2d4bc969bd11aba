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
    "SparseEmbedding": "longboat.ps.trainer.sparse",
    "distribute": "longboat.ps.trainer.engine",
    "save": "longboat.ps.trainer.engine",
    "shrink": "longboat.ps.trainer.table_admin",
    "table_stats": "longboat.ps.trainer.table_admin",
    "current": "longboat.ps.trainer.engine",
    "PSConfig": "longboat.ps.trainer.engine",
    "PSError": "longboat.ps.trainer.client",
    "SettingsMismatch": "longboat.ps.trainer.settings",
    "ServerLimits": "longboat.ps.server.limits",
    "Client": "longboat.ps.trainer.client",
    "KVClient": "longboat.ps.trainer.kv",
    "make_plan": "longboat.ps.trainer.plan",
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
