"""The parameter-server process: ``rpc`` (gRPC handlers, ``Server``, ``run_server``, the command
line) around ``state.ServerState`` (what a server holds and how requests change it: ``roster``,
``aggregation``, ``barriers``, dense ``blocks``, sparse ``tables`` over ``table_store``,
``row_index`` and ``row_file``), each request read first by its validator (``schema``); the
token check and body deadline at call start (``guard``), what callers may hold (``limits``),
checkpoints (``checkpoint``), and ``local`` (server states inside another process, for
``longboat.kvstore``'s local stores). Nothing here imports ``longboat.ps.trainer``.

    python -m longboat.ps.server --endpoint 127.0.0.1:7000 --index 0 --servers 2
    from longboat.ps.server import Server

The names below are imported on first use, so importing a submodule (e.g. ``state``) does not
load the gRPC server.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = ("Server", "CallError", "run_server", "make_server", "serve_until_done", "main")
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'longboat.ps.server' has no attribute {name!r}")
    value = getattr(importlib.import_module("longboat.ps.server.rpc"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
