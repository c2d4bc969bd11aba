"""A rank's slices of the sharded optimizer state in parameter coordinates, independent of the
world and bucket layout that cut them, and how slices held elsewhere fill another layout.

A *segment* ``(param, start, stop)`` names elements ``[start, stop)`` of trained parameter
``param`` (its index in the reducer's order, elements in memory order). `local_slices` is what
a rank holds: its pieces as segments and, per piece, the flat shaped state (Adam's moments);
the per-rank checkpoint files (`longboat.sharding.zero.files`) and the elastic
resharding (`longboat.elastic.reshard`) both move state in this form. `assign`
says who supplies each wanted element; `fill` sets the state of a (new) layout's pieces from
them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from longboat.sharding.zero.held import put, shaped_state
from longboat.sharding.zero.state import describe, is_shaped, scalars

if TYPE_CHECKING:
    from longboat.sharding.zero.shard_optimizer import ShardOptimizer

Segment = tuple[int, int, int]
"""``(param, start, stop)``: elements ``[start, stop)`` of a trained parameter."""

Supply = tuple[int, int, int, int]
"""``(holder, j, start, stop)``: elements ``[start, stop)`` come from segment ``j`` of
``holder`` (the parameter is the segment's)."""


def segments(step: ShardOptimizer) -> list[Segment]:
    """This rank's pieces (those the optimizer steps) as segments, in ``step.pieces`` order."""
    return [(p.param, p.start, p.stop) for _, p in step.pieces]


def local_slices(step: ShardOptimizer) -> dict[str, Any]:
    """What this rank holds: ``pieces`` (segments), ``state`` (per piece, the shaped state as
    flat tensors: the optimizer's own, not copies), ``groups`` (`describe`: dtypes and
    scalars per user group) and ``shard`` (the world, rank, degree and shard index)."""
    return {
        "pieces": [list(s) for s in segments(step)],
        "state": [shaped_state(step, k) for k in range(len(step.shard_params))],
        "groups": describe(step),
        "shard": shard_of(step),
    }


def shard_of(step: ShardOptimizer) -> dict[str, int]:
    """Where ``step`` sits: the world size, this rank, the shard degree and its index."""
    return {
        "world": dist.get_world_size(),
        "rank": dist.get_rank(),
        "degree": step.groups.degree,
        "index": step.groups.index,
    }


def stateful(slices: Mapping[str, Any]) -> tuple[list[Segment], list[dict[str, torch.Tensor]]]:
    """The segments of ``slices`` that hold state, and their state (a piece not yet stepped
    holds none)."""
    kept = [
        ((int(p), int(a), int(b)), held)
        for (p, a, b), held in zip(slices["pieces"], slices["state"], strict=True)
        if held
    ]
    return [seg for seg, _ in kept], [held for _, held in kept]


def assign(
    holdings: Mapping[int, Sequence[Segment]], wanted: Iterable[Segment]
) -> tuple[list[Supply], list[Segment]]:
    """Who supplies each wanted element (the lowest-numbered holder that holds it), and the
    wanted elements no holder holds. Every rank that knows the same holdings gets the same
    answer."""
    by_param: dict[int, list[tuple[int, int, int, int]]] = {}
    for holder in sorted(holdings):
        for j, (p, a, b) in enumerate(holdings[holder]):
            by_param.setdefault(p, []).append((holder, j, a, b))
    supply: list[Supply] = []
    missing: list[Segment] = []
    for p, start, stop in wanted:
        held = [(h, j, a, b) for h, j, a, b in by_param.get(p, []) if a < stop and start < b]
        edges = {start, stop}
        for *_, a, b in held:
            edges |= {max(a, start), min(b, stop)}
        cuts = sorted(edges)
        for lo, hi in zip(cuts, cuts[1:], strict=False):
            source = next(((h, j) for h, j, a, b in held if a <= lo and hi <= b), None)
            if source is None:
                _extend(missing, (p, lo, hi))
            elif supply and supply[-1][:2] == source and supply[-1][3] == lo:
                supply[-1] = (*source, supply[-1][2], hi)
            else:
                supply.append((*source, lo, hi))
    return supply, missing


def _extend(out: list[Segment], seg: Segment) -> None:
    """Append ``seg``, merged with the last segment when they touch."""
    if out and out[-1][0] == seg[0] and out[-1][2] == seg[1]:
        out[-1] = (seg[0], out[-1][1], seg[2])
    else:
        out.append(seg)


def fill(
    step: ShardOptimizer,
    groups: Mapping[int, Mapping[str, dict[str, Any]]],
    holdings: Mapping[int, Sequence[Segment]],
    read: Callable[[int, int], Mapping[str, torch.Tensor]],
) -> list[Segment]:
    """Set the state of every piece of ``step`` whose user group ``groups`` describes
    (`describe`'s entries): its shaped state from the holders (``read(holder, j)``: the flat
    shaped state of the holder's segment ``j``), its scalars from the description. Returns
    the elements no holder held (their pieces are left without state)."""
    lost: list[Segment] = []
    for k, seg in enumerate(segments(step)):
        group = step.pieces[k][1].group
        info = groups.get(group, {}) if group is not None else {}
        shaped: dict[str, torch.Tensor] = {}
        if any(is_shaped(entry) for entry in info.values()):
            supply, missing = assign(holdings, [seg])
            if missing:
                lost.extend(missing)
                continue
            for holder, j, lo, hi in supply:
                a = holdings[holder][j][1]
                for key, value in read(holder, j).items():
                    out = shaped.get(key)
                    if out is None:
                        out = shaped[key] = value.new_empty(seg[2] - seg[1])
                    out[lo - seg[1] : hi - seg[1]].copy_(value[lo - a : hi - a])
        put(step, k, shaped, scalars(info))
    return lost
