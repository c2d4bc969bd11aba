"""Spawn real ranks for multi-process tests and always clean them up."""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(
    rank: int,
    world_size: int,
    port: int,
    out_dir: str,
    env: dict[str, str],
    fn: Callable[..., Any],
    args: tuple,
) -> None:
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "OMP_NUM_THREADS": "1",
        }
    )
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir, f"{rank}.pt"))
    except BaseException:
        Path(out_dir, f"{rank}.err").write_text(traceback.format_exc())
        os._exit(1)
    finally:
        if torch.distributed.is_initialized():
            with contextlib.suppress(Exception):
                torch.distributed.destroy_process_group()


class RanksFailed(RuntimeError):
    """One or more spawned ranks raised; `errors` maps rank to its traceback."""

    def __init__(self, errors: dict[int, str], exitcodes: dict[int, int | None]):
        self.errors = errors
        self.exitcodes = exitcodes
        parts = [f"rank {r}: exit {c}" for r, c in exitcodes.items() if c != 0]
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        super().__init__("; ".join(parts) + "\n" + text)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    env: dict[str, str] | None = None,
    allow_failure: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes.

    Returns each rank's return value (saved with torch.save, loaded with weights_only=True),
    or raises RanksFailed with every failing rank's traceback. With ``allow_failure`` the
    RanksFailed is returned instead of raised. Every child is killed on the way out.
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="lb-test-") as out_dir:
        procs = [
            ctx.Process(
                target=_child,
                args=(r, world_size, port, out_dir, env or {}, fn, args),
                daemon=True,
            )
            for r in range(world_size)
        ]
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout
            while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
                time.sleep(0.05)
            timed_out = any(p.is_alive() for p in procs)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(5)
        errors = {
            r: Path(out_dir, f"{r}.err").read_text()
            for r in range(world_size)
            if Path(out_dir, f"{r}.err").exists()
        }
        codes = {r: p.exitcode for r, p in enumerate(procs)}
        if timed_out:
            errors.setdefault(-1, f"timed out after {timeout:.0f}s")
        if errors or any(c != 0 for c in codes.values()):
            failure = RanksFailed(errors, codes)
            if allow_failure:
                return failure  # type: ignore[return-value]
            raise failure
        return [torch.load(Path(out_dir, f"{r}.pt"), weights_only=True) for r in range(world_size)]


def join_as_emulated_nodes(rank: int, ranks_per_node: int, world: int) -> None:
    """In a rank of `run_ranks`: pretend consecutive groups of ``ranks_per_node`` ranks are
    nodes (longboat's node variables), then ``lb.init`` on Gloo."""
    import longboat as lb

    os.environ.update(
        LONGBOAT_NODE_RANK=str(rank // ranks_per_node),
        LONGBOAT_NNODES=str(world // ranks_per_node),
        LOCAL_RANK=str(rank % ranks_per_node),
        LOCAL_WORLD_SIZE=str(ranks_per_node),
    )
    lb.init(backend="gloo")
