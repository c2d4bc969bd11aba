"""Sharding stage 3 in an elastic job: this rank's shards of the parameters and of their
optimizer state kept at each commit, and moved in memory to a new world's shards.

FSDP2 splits each parameter along its first dimension, so a rank's shard of a parameter is a
flat range of its elements: a *segment* ``(param, start, stop)`` (param: its index in
``named_parameters()`` order), as stages 1 and 2 describe their slices
(`longboat.sharding.zero.slices`). At a commit a rank keeps its segments' values and
their optimizer state shaped like the parameter (Adam's moments), the scalar state (Adam's
``step``) and the module's buffers. After a membership change the ranks tell each other (JSON)
which segments they held at their last commit; if every element of every parameter is held
by some rank at the latest commit, each element is summed into place over the world from one
holder (the others add zeros), a bucket of parameters and one state key at a time, and each
rank keeps the rows of its new shards. Otherwise `ShardsLostError` names what was lost.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from longboat.comm.exchange import allgather_bytes, control_device
from longboat.elastic.reshard import ShardsLostError, latest_holders, lost_line
from longboat.sharding.optimizer import FullyShardedStep
from longboat.sharding.zero.slices import Segment, assign

BUCKET_ELEMENTS = 1 << 24
"""Elements summed over the world in one collective when shards move (64 MB of float32)."""
PARAM = ""
"""The key of the parameters' own values among the optimizer state's keys."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def flat_range(p: torch.Tensor) -> tuple[int, int]:
    """The elements ``[start, stop)`` of the whole (flattened) parameter this rank holds."""
    if not isinstance(p, DTensor):
        return 0, p.numel()
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    count = 1
    for n in shape:
        count *= n
    if count == 0:
        return 0, 0
    row = p.numel() // p.shape[0] if p.dim() else 1
    start = offset[0] * row if p.dim() else 0
    return start, start + count


def _named(step: FullyShardedStep) -> list[tuple[str, nn.Parameter]]:
    return list(step.model.named_parameters())


def _shaped(value: Any, p: torch.Tensor, key: str, name: str) -> bool:
    """Is the optimizer state ``value`` shaped like its parameter (split like it)? ValueError
    for a tensor split otherwise, which cannot be resharded by rows."""
    if isinstance(value, DTensor):
        if value.shape != p.shape or value.placements != getattr(p, "placements", None):
            raise ValueError(
                f"optimizer state {key!r} of {name} has shape {tuple(value.shape)} and the "
                f"parameter {tuple(p.shape)}: an elastic job at sharding stage 3 moves optimizer "
                "state shaped like its parameter only; use stage 1 or 2 for this optimizer"
            )
        return True
    return False


def shard_of(step: FullyShardedStep) -> dict[str, int]:
    """Where this rank sits: the world size, its rank, the shard degree and its shard index."""
    index = 0
    for _, p in _named(step):
        if isinstance(p, DTensor):
            index = p.device_mesh.get_local_rank(mesh_dim="shard")
            break
    return {
        "world": dist.get_world_size(),
        "rank": dist.get_rank(),
        "degree": step.degree,
        "index": index,
    }


def local_shards(step: FullyShardedStep) -> dict[str, Any]:
    """What this rank holds: ``pieces`` (segments), per piece its values (``params``) and
    shaped optimizer state (``state``), flat; ``scalars`` (per parameter, the rest of its
    optimizer state), ``buffers`` (by name) and ``shard`` (`shard_of`). Views of the live
    tensors where they are contiguous: snapshot them (``TensorTree``) before the next step."""
    pieces, values, state, scalars = [], [], [], []
    for i, (name, p) in enumerate(_named(step)):
        per = step.optimizer.state.get(p, {})
        shaped = {k for k, v in per.items() if _shaped(v, p, k, name)}
        scalars.append({k: v for k, v in per.items() if k not in shaped})
        start, stop = flat_range(p)
        if start == stop:
            continue
        pieces.append([i, start, stop])
        values.append(_local(p).detach().reshape(-1))
        state.append({k: _local(per[k]).reshape(-1) for k in sorted(shaped)})
    return {
        "pieces": pieces,
        "params": values,
        "state": state,
        "scalars": scalars,
        "buffers": dict(step.model.named_buffers()),
        "shard": shard_of(step),
    }


def restore(step: FullyShardedStep, saved: Mapping[str, Any]) -> None:
    """Load a `local_shards` snapshot in place when this rank's shards are still the ones it
    took (no communication); a model sharded anew since waits for `reshard`."""
    if not dist.is_initialized() or saved["shard"] != shard_of(step):
        return
    named = _named(step)
    here = [[i, *flat_range(p)] for i, (_, p) in enumerate(named)]
    if [list(piece) for piece in saved["pieces"]] != [h for h in here if h[1] < h[2]]:
        return
    values = {int(i): v for (i, _, _), v in zip(saved["pieces"], saved["params"], strict=True)}
    shaped = {int(i): s for (i, _, _), s in zip(saved["pieces"], saved["state"], strict=True)}
    with torch.no_grad():
        for i, (_, p) in enumerate(named):
            if i in values:
                _local(p).copy_(values[i].view_as(_local(p)))
            _put(step, p, shaped.get(i, {}), saved["scalars"][i])
    _set_buffers(step.model, saved["buffers"])


def _put(
    step: FullyShardedStep,
    p: torch.Tensor,
    shaped: Mapping[str, torch.Tensor],
    scalars: Mapping[str, Any],
) -> None:
    """Set ``p``'s optimizer state: ``shaped`` (flat, this rank's rows) and ``scalars``."""
    state: dict[str, Any] = {}
    local = _local(p)
    for key, flat in shaped.items():
        mine = flat.to(local.device).view(local.shape).clone()
        if isinstance(p, DTensor):
            mine = DTensor.from_local(
                mine, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
        state[key] = mine
    for key, value in scalars.items():
        state[key] = value.clone() if isinstance(value, torch.Tensor) else value
    if state:
        step.optimizer.state[p] = state
    else:
        step.optimizer.state.pop(p, None)


def _set_buffers(module: nn.Module, buffers: Mapping[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, value in buffers.items():
            module.get_buffer(name).copy_(value)


def reshard(step: FullyShardedStep, held: Mapping[str, Any] | None, commits: int) -> None:
    """Give ``step``'s model (sharded for this world) and optimizer their shards from what the
    ranks hold: ``held`` is this rank's `local_shards` at commit ``commits`` (None: nothing, a
    newcomer). Collective over the world. Nothing changes when no rank holds state;
    `ShardsLostError` (on every rank) when some element is held by no rank at the latest
    commit."""
    mine = {
        "holds": held is not None,
        "commits": commits,
        "pieces": held["pieces"] if held is not None else [],
        "shard": held["shard"] if held is not None else None,
    }
    found = latest_holders(mine)
    if found is None:
        return  # a fresh start, or state loaded by each rank itself: left as it is
    metas, holders = found
    named = _named(step)
    wanted = [(i, 0, p.numel()) for i, (_, p) in enumerate(named)]
    supply, missing = assign(holders, wanted)
    if missing:
        raise ShardsLostError(_lost(named, missing, [metas[r]["shard"] for r in holders]))
    source = min(holders)
    common = _from(source, held if dist.get_rank() == source else None)
    rank = dist.get_rank()
    with torch.no_grad():
        shaped = _transfer(named, common["keys"], supply, holders.get(rank, []), held)
        for i, (_, p) in enumerate(named):
            _put(step, p, shaped.get(i, {}), common["scalars"][i])
    if len(holders) < len(metas):  # some rank received the state: every rank takes source's
        _set_buffers(step.model, common["buffers"])
    elif held is not None:
        _set_buffers(step.model, held["buffers"])


def _from(source: int, held: Mapping[str, Any] | None) -> dict[str, Any]:
    """What rank ``source`` sends every rank (collective): per parameter, the dtype of each
    shaped state key and its scalar state, and the module's buffers."""
    data = b""
    if held is not None:
        keys = [{} for _ in held["scalars"]]
        for (i, _, _), state in zip(held["pieces"], held["state"], strict=True):
            keys[int(i)] = {k: str(v.dtype).removeprefix("torch.") for k, v in state.items()}
        buffer = io.BytesIO()
        sent = {"keys": keys, "scalars": held["scalars"], "buffers": held["buffers"]}
        torch.save(_to_cpu(sent), buffer)
        data = buffer.getvalue()
    payload = allgather_bytes(data)[source]
    return torch.load(io.BytesIO(payload), weights_only=True)


def _to_cpu(node: Any) -> Any:
    if isinstance(node, torch.Tensor):
        return node.detach().cpu()
    if isinstance(node, dict):
        return {k: _to_cpu(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_to_cpu(v) for v in node]
    return node


def _buckets(
    named: list[tuple[str, nn.Parameter]], keys: list[dict[str, str]]
) -> Iterator[tuple[str, torch.dtype, list[tuple[int, int]]]]:
    """``(key, dtype, [(param, offset), ...])``: the parameters' values (key `PARAM`), then
    each shaped state key, packed into buckets of one dtype and at most `BUCKET_ELEMENTS`
    (a larger parameter alone), in the same order on every rank."""
    lanes: dict[tuple[str, str], list[int]] = {}
    for i, (_, p) in enumerate(named):
        lanes.setdefault((PARAM, str(p.dtype).removeprefix("torch.")), []).append(i)
    for i, per in enumerate(keys):
        for key, dtype in sorted(per.items()):
            lanes.setdefault((key, dtype), []).append(i)
    for (key, dtype), members in lanes.items():
        bucket: list[tuple[int, int]] = []
        size = 0
        for i in members:
            n = named[i][1].numel()
            if bucket and size + n > BUCKET_ELEMENTS:
                yield key, getattr(torch, dtype), bucket
                bucket, size = [], 0
            bucket.append((i, size))
            size += n
        if bucket:
            yield key, getattr(torch, dtype), bucket


def _transfer(
    named: list[tuple[str, nn.Parameter]],
    keys: list[dict[str, str]],
    supply: list[tuple[int, int, int, int]],
    mine: list[Segment],
    held: Mapping[str, Any] | None,
) -> dict[int, dict[str, torch.Tensor]]:
    """Each element summed over the world from the one rank that supplies it: the new
    parameters' rows are written in place; returns the new shaped state, per parameter."""
    rank = dist.get_rank()
    device = control_device()
    supplied: dict[int, list[tuple[int, int, int]]] = {}
    for holder, j, lo, hi in supply:
        if holder == rank:
            supplied.setdefault(mine[j][0], []).append((j, lo, hi))
    shaped: dict[int, dict[str, torch.Tensor]] = {}
    for key, dtype, bucket in _buckets(named, keys):
        size = bucket[-1][1] + named[bucket[-1][0]][1].numel()
        buf = torch.zeros(size, dtype=dtype, device=device)
        for i, offset in bucket:
            for j, lo, hi in supplied.get(i, []):
                assert held is not None
                flat = held["params"][j] if key == PARAM else held["state"][j][key]
                a = mine[j][1]
                buf[offset + lo : offset + hi].copy_(flat[lo - a : hi - a])
        dist.all_reduce(buf)  # one holder per element: the sum is its value
        for i, offset in bucket:
            p = named[i][1]
            start, stop = flat_range(p)
            rows = buf[offset + start : offset + stop]
            if key == PARAM:
                local = _local(p)
                local.copy_(rows.view(local.shape))
            else:
                shaped.setdefault(i, {})[key] = rows.clone()
    return shaped


def _lost(
    named: list[tuple[str, nn.Parameter]], missing: list[Segment], shards: list[dict[str, int]]
) -> str:
    """One line: what was lost, where it was, and the ways back."""
    count = sum(b - a for _, a, b in missing)
    shown = ", ".join(f"{named[i][0]}[{a}:{b}]" for i, a, b in missing[:3])
    more = f" and {len(missing) - 3} more ranges" if len(missing) > 3 else ""
    return lost_line(
        f"sharding stage 3: {count} elements of the parameters and their optimizer state "
        f"({shown}{more}) are",
        shards,
        "Training on would start them from uninitialised memory",
        " (the default across nodes)",
    )
