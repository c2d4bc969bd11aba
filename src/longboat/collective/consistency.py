"""Start-up agreement: every rank has the same model and settings, then rank 0's values
everywhere."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from longboat.comm.algorithms import AllreduceFn
from longboat.comm.exchange import allgather_bytes
from longboat.comm.handles import wait_for

_SUMMABLE_INTS = (torch.int64, torch.int32)  # integer buffers the algorithms can sum


class ModelMismatchError(RuntimeError):
    """Ranks built different models (names, shapes or dtypes differ)."""


class SettingsMismatchError(RuntimeError):
    """Ranks run with different Strategy settings for what they exchange."""


_SHOWN_FIELDS = 8


def verify_same_settings(
    settings: Mapping[str, tuple[Any, str]], group: dist.ProcessGroup | None = None
) -> None:
    """Raise SettingsMismatchError on every rank if any rank's settings differ from another's.

    ``settings`` is ``{"field" or "field.key": (value, source)}``, every Strategy setting
    that shapes communication (``CollectivePlan.shared_settings``). Each rank publishes it as
    JSON, all ranks receive all of them, so every rank raises the same message naming each
    differing field, the value on each rank and where it came from (default, code, file,
    env:LONGBOAT_X).
    """
    mine = {path: list(pair) for path, pair in settings.items()}
    tables = [json.loads(blob) for blob in allgather_bytes(json.dumps(mine).encode(), group)]
    differing = [
        name
        for name in mine
        if any(json.dumps(t.get(name, [None])[0]) != json.dumps(tables[0][name][0]) for t in tables)
    ]
    if not differing:
        return
    lines = [f"  {name}: {_values_by_rank(name, tables)}" for name in differing[:_SHOWN_FIELDS]]
    if len(differing) > _SHOWN_FIELDS:
        lines.append(f"  ... and {len(differing) - _SHOWN_FIELDS} more fields")
    raise SettingsMismatchError(
        f"Strategy settings differ between ranks ({len(differing)} field(s)); ranks that "
        "disagree on them would hang or exchange mismatched data:\n"
        + "\n".join(lines)
        + "\nGive every rank the same Strategy: the same code, --config file and LONGBOAT_* "
        "variables on every node."
    )


def _values_by_rank(name: str, tables: list[dict[str, list[Any]]]) -> str:
    """``2 on ranks 0-2 (default); 4 on rank 3 (env:LONGBOAT_X)``: ranks grouped by value."""
    groups: dict[str, tuple[Any, list[int], str]] = {}
    for rank, table in enumerate(tables):
        value, source = table.get(name, [None, "missing"])
        key = json.dumps(value, sort_keys=True)
        if key not in groups:
            groups[key] = (value, [], source)
        groups[key][1].append(rank)
    parts = [f"{value!r} on {_ranks(ranks)} ({source})" for value, ranks, source in groups.values()]
    return "; ".join(parts)


def _ranks(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 0-2, 5``."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)
    return ("rank " if len(ranks) == 1 else "ranks ") + text


def _signature(module: nn.Module) -> list[list[str]]:
    entries = [("param", n, p) for n, p in module.named_parameters()]
    entries += [("buffer", n, b) for n, b in module.named_buffers()]
    return [
        [kind, name, str(tuple(t.shape)), str(t.dtype).removeprefix("torch.")]
        for kind, name, t in entries
    ]


def verify_same_model(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Raise ModelMismatchError on every rank if any rank's model differs from rank 0's.

    Each rank publishes its parameter and buffer names, shapes and dtypes as JSON; all ranks
    receive all signatures, so every rank raises the same message naming the first
    difference and the ranks involved instead of hanging in a later collective.
    """
    mine = json.dumps(_signature(module)).encode()
    signatures = [json.loads(blob) for blob in allgather_bytes(mine, group)]
    reference = signatures[0]
    for rank, sig in enumerate(signatures[1:], start=1):
        problem = _first_difference(reference, sig)
        if problem:
            raise ModelMismatchError(
                f"the model on rank {rank} differs from rank 0: {problem}. Every rank must "
                "build the same model (same layers, shapes and dtypes, in the same order) "
                "before lb.distribute."
            )


def _first_difference(ref: list[list[str]], other: list[list[str]]) -> str | None:
    for i, (a, b) in enumerate(zip(ref, other, strict=False)):
        if a != b:
            return (
                f"entry #{i}: rank 0 has {a[0]} {a[1]!r} shape {a[2]} {a[3]}, "
                f"the other has {b[0]} {b[1]!r} shape {b[2]} {b[3]}"
            )
    if len(ref) != len(other):
        longer, who = (ref, "rank 0") if len(ref) > len(other) else (other, "the other rank")
        extra = longer[min(len(ref), len(other))]
        return (
            f"{who} has {len(longer) - min(len(ref), len(other))} more parameters/buffers, "
            f"starting with {extra[0]} {extra[1]!r} shape {extra[2]}"
        )
    return None


def broadcast_state(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    src: int = 0,
    coalesce: bool = True,
    allreduce_fn: AllreduceFn | None = None,
) -> None:
    """Overwrite ``tensors`` in place with rank ``src``'s values.

    With ``coalesce`` tensors of one dtype and device travel as one flat broadcast
    (Fleet's ``fuse_broadcast_ops``), otherwise one broadcast per tensor. With
    ``allreduce_fn`` (a faster algorithm than the backend's broadcast, e.g. shared memory)
    every rank but ``src`` contributes zeros to an allreduce, whose sum is ``src``'s values.
    """
    if dist.get_world_size(group) == 1:
        return
    global_src = dist.get_global_rank(group, src) if group is not None else src
    me = dist.get_rank(group)

    def send(t: torch.Tensor) -> None:
        if allreduce_fn is None or not (t.is_floating_point() or t.dtype in _SUMMABLE_INTS):
            dist.broadcast(t, src=global_src, group=group)
            return
        if me != src:
            t.zero_()
        wait_for(allreduce_fn(t))

    with torch.no_grad():
        if not coalesce:
            for t in tensors:
                send(t.data)
            return
        by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in tensors:
            by_kind.setdefault((t.dtype, t.device), []).append(t.data)
        for same in by_kind.values():
            flat = _flatten_dense_tensors(same)
            send(flat)
            for t, value in zip(same, _unflatten_dense_tensors(flat, same), strict=True):
                t.copy_(value)
