"""A digest of everything a parameter server holds, to show that a refused request changed
nothing: every attribute of its ``ServerState`` (blocks, optimizer state, tables, pending
pushes, barriers, liveness records, counters), the server's own records (stops, restores) and
the checkpoint files it wrote. New attributes are covered without listing them here."""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Any

import torch

from longboat.ps.server import Server

_SKIPPED_STATE = {"cond", "clock", "on_version"}  # the lock and callables: not data
_SERVER = ("_stopped", "_restores", "_restored", "restored_step", "finished", "boot")


def fingerprint(server: Server) -> str:
    """A hex digest that changes whenever anything the server holds changes."""
    h = hashlib.sha256()
    seen: set[int] = set()

    def feed(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            flat = x.detach().reshape(-1).contiguous()
            h.update(f"T{x.dtype}{tuple(x.shape)}:".encode())
            h.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
        elif x is None or isinstance(x, str | int | float | bool | bytes):
            h.update(f"{type(x).__name__}:{x!r};".encode())
        elif isinstance(x, dict):
            h.update(b"{")
            for k in sorted(x, key=repr):
                feed(k)
                feed(x[k])
            h.update(b"}")
        elif isinstance(x, list | tuple):
            h.update(b"[")
            for v in x:
                feed(v)
            h.update(b"]")
        elif isinstance(x, set | frozenset):
            feed(sorted(x, key=repr))
        elif isinstance(x, threading.Event):
            feed(x.is_set())
        elif isinstance(x, torch.optim.Optimizer):
            feed(x.state_dict())
        elif isinstance(x, torch.dtype):
            feed(str(x))
        elif id(x) not in seen and hasattr(x, "__dict__"):
            seen.add(id(x))
            h.update(type(x).__name__.encode())
            feed({k: v for k, v in vars(x).items() if not callable(v)})
        elif not callable(x) and id(x) not in seen:
            raise TypeError(f"fingerprint cannot read a {type(x).__name__}")

    feed({k: v for k, v in vars(server.state).items() if k not in _SKIPPED_STATE})
    feed({k: getattr(server, k) for k in _SERVER})
    if server.checkpoint_dir is not None and server.checkpoint_dir.exists():
        files = sorted(os.scandir(server.checkpoint_dir), key=lambda e: e.name)
        feed([(e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in files])
    return h.hexdigest()
