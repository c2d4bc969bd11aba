"""The sharding plan (Paddle's split -> send -> recv -> concat): which server holds which rows.

Every dense parameter is split along dim 0 into at most ``num_servers`` blocks of at least
``min_block_size`` elements (a parameter smaller than that stays one block; a block never
exceeds ``max_block_numel``). Blocks are dealt out in descending size, each to the least-loaded
server (ties: the lowest index), so server loads differ by at most one block. The plan depends
only on the parameters' names and shapes: every trainer computes the same one, and servers
compare its digest.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_MIN_BLOCK_SIZE = 8192
DEFAULT_MAX_BLOCK_NUMEL = 8 << 20  # 32 MB of float32: keeps every message far below the cap


@dataclass(frozen=True)
class Block:
    """Rows ``[start, stop)`` of parameter ``param``, held by ``server`` under ``key``."""

    key: str
    param: str
    start: int
    stop: int
    shape: tuple[int, ...]  # the block's own shape
    server: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ShardingPlan:
    """All blocks in parameter order (the order concat uses) and where they live."""

    blocks: tuple[Block, ...]
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    num_servers: int

    def of_param(self, name: str) -> list[Block]:
        return [b for b in self.blocks if b.param == name]

    def of_server(self, server: int) -> list[Block]:
        return [b for b in self.blocks if b.server == server]

    def loads(self) -> list[int]:
        """Elements held by each server."""
        out = [0] * self.num_servers
        for b in self.blocks:
            out[b.server] += b.numel
        return out

    def digest(self) -> str:
        """A short hash of the plan: equal on every trainer that built the same model."""
        text = ";".join(f"{b.key}:{b.start}:{b.stop}:{b.shape}:{b.server}" for b in self.blocks)
        return hashlib.sha256(f"{self.num_servers}|{text}".encode()).hexdigest()[:16]

    def describe(self) -> str:
        """A printable table: one line per block, then the load of every server."""
        lines = [f"{'block':<40} {'rows':>15} {'elements':>10}  server"]
        for b in self.blocks:
            lines.append(f"{b.key:<40} {f'{b.start}:{b.stop}':>15} {b.numel:>10}  {b.server}")
        loads = ", ".join(f"server {i}: {n}" for i, n in enumerate(self.loads()))
        lines.append(f"plan {self.digest()}: {len(self.blocks)} blocks; {loads}")
        return "\n".join(lines)


def split_rows(
    shape: Sequence[int], num_servers: int, min_block_size: int, max_block_numel: int
) -> list[tuple[int, int]]:
    """Row ranges ``[start, stop)`` along dim 0 for a parameter of ``shape``."""
    rows = shape[0] if shape else 1
    row_numel = math.prod(shape[1:]) if shape else 1
    if rows == 0:
        return [(0, 0)]
    n = min(num_servers, rows)
    while n > 1 and (rows // n) * row_numel < min_block_size:
        n -= 1
    n = min(rows, max(n, math.ceil(rows * row_numel / max_block_numel)))
    base, extra = divmod(rows, n)
    bounds, start = [], 0
    for i in range(n):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def make_plan(
    shapes: Sequence[tuple[str, Sequence[int]]],
    num_servers: int,
    min_block_size: int = DEFAULT_MIN_BLOCK_SIZE,
    max_block_numel: int = DEFAULT_MAX_BLOCK_NUMEL,
) -> ShardingPlan:
    """The plan for named parameter ``shapes`` (in model order) over ``num_servers`` servers."""
    if num_servers < 1:
        raise ValueError(f"num_servers must be >= 1, got {num_servers}")
    if min_block_size < 1 or max_block_numel < min_block_size:
        raise ValueError(
            f"need 1 <= min_block_size <= max_block_numel, got {min_block_size}, {max_block_numel}"
        )
    names = [n for n, _ in shapes]
    if len(set(names)) != len(names):
        raise ValueError("parameter names must be unique")
    pieces: list[tuple[str, int, int, int, tuple[int, ...]]] = []
    for name, shape in shapes:
        shape = tuple(int(s) for s in shape)
        ranges = split_rows(shape, num_servers, min_block_size, max_block_numel)
        for i, (start, stop) in enumerate(ranges):
            own = (stop - start, *shape[1:]) if shape else ()
            pieces.append((name, i, start, stop, own))
    order = sorted(range(len(pieces)), key=lambda j: (-math.prod(pieces[j][4]), j))
    loads = [0] * num_servers
    server_of: dict[int, int] = {}
    for j in order:
        server = min(range(num_servers), key=lambda s: (loads[s], s))
        server_of[j] = server
        loads[server] += math.prod(pieces[j][4])
    blocks = tuple(
        Block(f"{name}/{i}", name, start, stop, own, server_of[j])
        for j, (name, i, start, stop, own) in enumerate(pieces)
    )
    return ShardingPlan(
        blocks, tuple((n, tuple(int(x) for x in s)) for n, s in shapes), num_servers
    )
