"""The sharded optimizer state moved in memory to a new world's layout after an elastic
membership change, or a loud stop when part of it left with a rank.

Every rank brings what it held at its last commit (`longboat.sharding.zero.slices`:
segments in parameter coordinates; a rank that joined brings nothing). The ranks tell each
other what they hold in JSON; if every element of the state is held by some rank at the
latest commit, each element is summed into place over the world from one holder (zeros from
the others), bucket by bucket of the new layout, and each rank keeps its new pieces. Otherwise
`ShardsLostError`, on every rank, names the shards that left: training on would step those
elements from zero state.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from longboat.comm.exchange import allgather_bytes, any_rank
from longboat.elastic.membership import ElasticError
from longboat.sharding.zero.held import put
from longboat.sharding.zero.slices import Segment, assign, fill, segments, stateful
from longboat.sharding.zero.state import is_shaped, scalars

if TYPE_CHECKING:
    from longboat.sharding.zero.shard_optimizer import ShardOptimizer

Groups = dict[int, dict[str, dict[str, Any]]]


class ShardsLostError(ElasticError):
    """Part of the sharded optimizer state was held only by ranks that left the job."""


def reshard(step: ShardOptimizer, held: Mapping[str, Any] | None, commits: int) -> None:
    """Give ``step`` (built for this world) its pieces' state from what the ranks hold:
    ``held`` is this rank's `local_slices` at commit ``commits`` (None: it holds nothing, a
    newcomer). Collective over the world. Nothing changes when no rank holds state;
    `ShardsLostError` when some element is held by no rank at the latest commit."""
    segs, states = stateful(held) if held is not None else ([], [])
    mine = {
        "holds": held is not None,
        "commits": commits,
        "pieces": segs,
        "groups": held["groups"] if held is not None else {},
        "shard": held["shard"] if held is not None else None,
    }
    found = latest_holders(mine)
    if found is None:
        return  # a fresh start, or state loaded by each rank itself: left as it is
    metas, holders = found
    groups: Groups = {}
    for r in holders:
        for g, info in metas[r]["groups"].items():
            groups.setdefault(int(g), info)
    wanted = _wanted(step, groups)
    _, missing = assign(holders, wanted)
    if missing:
        raise ShardsLostError(_lost(step, missing, [metas[r]["shard"] for r in holders]))
    rank = dist.get_rank()
    if step.optimizer is not None:
        step.optimizer.state.clear()
    in_place = rank in holders and not assign({rank: segs}, _mine(step, groups))[1]
    if any_rank(not in_place):
        _transfer(step, groups, holders, wanted, states)
    elif step.optimizer is not None:
        fill(step, groups, {rank: segs}, lambda _, j: states[j])


def latest_holders(
    mine: Mapping[str, Any],
) -> tuple[list[dict[str, Any]], dict[int, list[Segment]]] | None:
    """Collective: every rank's ``mine`` (``holds``, ``commits``, its ``pieces`` as segments,
    and what else a caller reads), and the pieces of each rank that holds state at the latest
    commit; None when no rank holds state."""
    metas = [json.loads(m) for m in allgather_bytes(json.dumps(mine).encode())]
    latest = max((m["commits"] for m in metas if m["holds"]), default=None)
    if latest is None:
        return None
    holders = {
        r: [(int(p), int(a), int(b)) for p, a, b in m["pieces"]]
        for r, m in enumerate(metas)
        if m["holds"] and m["commits"] == latest
    }
    return metas, holders


def _shaped_groups(groups: Groups) -> set[int]:
    return {g for g, info in groups.items() if any(is_shaped(e) for e in info.values())}


def _wanted(step: ShardOptimizer, groups: Groups) -> list[Segment]:
    """Every element whose param group holds shaped state."""
    shaped = _shaped_groups(groups)
    return [
        (i, 0, step.params[i].numel())
        for i, g in enumerate(step.group_of)
        if g is not None and g in shaped
    ]


def _mine(step: ShardOptimizer, groups: Groups) -> list[Segment]:
    """This rank's pieces whose param group holds shaped state."""
    shaped = _shaped_groups(groups)
    pieces = zip(segments(step), step.pieces, strict=True)
    return [seg for seg, (_, piece) in pieces if piece.group in shaped]


def _transfer(
    step: ShardOptimizer,
    groups: Groups,
    holders: Mapping[int, Sequence[Segment]],
    wanted: list[Segment],
    states: list[dict[str, torch.Tensor]],
) -> None:
    """Each element summed over the world from the one rank that supplies it, bucket by bucket
    and key by key of the new layout (one full bucket of one key in memory at a time)."""
    rank = dist.get_rank()
    supply, _ = assign(holders, wanted)
    supplied: dict[int, list[tuple[int, int, int]]] = {}
    for holder, j, lo, hi in supply:
        if holder == rank:
            supplied.setdefault(holders[holder][j][0], []).append((j, lo, hi))
    dtypes = {k: e["dtype"] for info in groups.values() for k, e in info.items() if is_shaped(e)}
    shaped: dict[int, dict[str, torch.Tensor]] = {k: {} for k in range(len(step.pieces))}
    stepped = {id(p): k for k, (_, p) in enumerate(step.pieces)}
    for s in step.layout.buckets:
        offset = dict(s.members)
        for key in sorted(dtypes):
            buf = torch.zeros(s.numel, dtype=getattr(torch, dtypes[key]), device=s.device)
            for p, off in s.members:
                for j, lo, hi in supplied.get(p, []):
                    if key in states[j]:
                        a = holders[rank][j][1]
                        buf[off + lo : off + hi].copy_(states[j][key][lo - a : hi - a])
            dist.all_reduce(buf)  # one holder per element: the sum is its value
            for piece in s.pieces:
                k = stepped.get(id(piece))
                info = groups.get(piece.group, {}) if piece.group is not None else {}
                if k is not None and is_shaped(info.get(key)):
                    at = offset[piece.param]
                    shaped[k][key] = buf[at + piece.start : at + piece.stop]
    if step.optimizer is not None:
        for k, (_, piece) in enumerate(step.pieces):
            info = groups.get(piece.group, {}) if piece.group is not None else {}
            put(step, k, shaped[k], scalars(info))


def _lost(step: ShardOptimizer, missing: list[Segment], shards: list[dict[str, int]]) -> str:
    """What was lost, where it was, and how to recover."""
    names = step.names
    count = sum(b - a for _, a, b in missing)
    shown = ", ".join(f"{names[p]}[{a}:{b}]" for p, a, b in missing[:3])
    more = f" and {len(missing) - 3} more ranges" if len(missing) > 3 else ""
    return lost_line(
        f"the sharded optimizer state of {count} elements ({shown}{more}) is",
        shards,
        "Training on would restart their optimizer state from zero",
        "",
    )


def lost_line(what: str, shards: list[dict[str, int]], why: str, default: str) -> str:
    """`ShardsLostError`'s one line at every sharding stage: ``what`` is lost, where it was
    (`lost_where`), ``why`` the job stops, and the ways back (``default``: when the default
    degree already keeps a copy per node)."""
    return (
        f"{what} lost: {lost_where(shards)}, and no rank of this world holds a copy. "
        f"{why}, so the job stops here. Give lb.elastic.State(checkpoint=DIR, "
        "checkpoint_every=N) a sharded checkpoint to resume from at such a change, or restart "
        "the job from one (lb.load_sharded_checkpoint at any world size). To survive losing a "
        "node in memory, shard within nodes: sharding_configs['sharding_degree'] at most the "
        f"ranks per node{default} keeps a whole copy on every node"
    )


def lost_where(shards: list[dict[str, int]]) -> str:
    """Which shards left and which ranks of the previous world held them, from the ``shard``
    entries (world, rank, degree, index) of the ranks that still hold state (shard groups of
    consecutive ranks' indices: rank % degree)."""
    if not shards:
        return "held only by ranks that left"
    world, degree = shards[0]["world"], shards[0]["degree"]
    gone = sorted(set(range(degree)) - {s["index"] for s in shards})
    ranks = [r for r in range(world) if r % degree in gone]
    return (
        f"shard{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} of {degree}, "
        f"held only by rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
        f"of the previous {world}-rank world, which left"
    )


def agree_on_checkpoint(directory: Path, lost: ShardsLostError) -> None:
    """Collective, before the ranks load the sharded checkpoint in ``directory`` instead of
    the ``lost`` shards: every rank sees the same save of it, or every rank raises
    `ShardsLostError` naming the ranks that see another (the load is collective at stage 3:
    a rank that skipped it would leave the others waiting)."""
    from longboat.sharding.checkpoint import saved_version

    seen = [b.decode() for b in allgather_bytes(str(saved_version(directory)).encode())]
    if len(set(seen)) == 1:
        return
    by_version: dict[str, list[int]] = {}
    for rank, version in enumerate(seen):
        by_version.setdefault(version, []).append(rank)
    views = "; ".join(
        f"{'ranks' if len(ranks) > 1 else 'rank'} {', '.join(map(str, ranks))}: "
        + ("none" if version == "None" else version)
        for version, ranks in by_version.items()
    )
    raise ShardsLostError(
        f"{lost} (the ranks see different saves of the checkpoint in {directory}: {views}; "
        "put it on a filesystem every node shares)"
    ) from None
