"""Horovod's ops that move rows between ranks: allgather, broadcast, alltoall, reducescatter.

Sizes may differ per rank where Horovod allows it (allgather rows, alltoall splits). Like the
reductions, each returns a handle or, in its differentiable form, a tensor whose gradient is
that of the sum of every rank's loss.
"""

from __future__ import annotations

from typing import Any

import torch

from longboat.horovod.torch import basics
from longboat.horovod.torch.compression import Compression, Compressor
from longboat.horovod.torch.ops import (
    Average,
    ProcessSet,
    Sum,
    check_process_set,
    global_process_set,
    register,
    resolve_op,
    submit,
    synchronize,
)
from longboat.horovod.torch.reductions import allreduce, check_scales
from longboat.horovod.torch.requests import (
    ALLGATHER,
    ALLTOALL,
    BROADCAST,
    REDUCESCATTER,
    ReduceOp,
)

# -- allgather --------------------------------------------------------------------------------


def allgather_async(
    tensor: torch.Tensor,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start concatenating every rank's ``tensor`` along dim 0 (sizes may differ)."""
    check_process_set(process_set)
    if tensor.dim() == 0:
        raise ValueError("allgather needs a tensor with at least one dimension; got a scalar")
    return register([submit(ALLGATHER, tensor, name, None)])


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None) -> torch.Tensor:  # type: ignore[override]
        ctx.rows = tensor.shape[0]
        return synchronize(allgather_async(tensor, name))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        reduced = allreduce(grad, op=Sum)
        rows = allgather(torch.tensor([ctx.rows], dtype=torch.int64))
        offset = int(rows[: basics.rank()].sum())
        return reduced.narrow(0, offset, ctx.rows), None


def allgather(
    tensor: torch.Tensor,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0 in rank order (differentiable)."""
    check_process_set(process_set)
    return _Allgather.apply(tensor, name)


# -- broadcast --------------------------------------------------------------------------------


def _check_root(root_rank: int) -> int:
    world = basics.size()
    if not 0 <= int(root_rank) < world:
        raise ValueError(f"root_rank={root_rank} is outside 0..{world - 1}")
    return int(root_rank)


def _start_broadcast(
    tensor: torch.Tensor,
    in_place: bool,
    root_rank: int,
    name: str | None,
    process_set: Any,
) -> int:
    """broadcast_async(_): into ``tensor`` itself (``in_place``) or into a new tensor."""
    check_process_set(process_set)
    root = _check_root(root_rank)
    output = tensor.data if in_place else tensor.detach().clone()
    return register([submit(BROADCAST, tensor, name, output, root=root)])


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start copying ``root_rank``'s ``tensor`` into a new tensor on every rank."""
    return _start_broadcast(tensor, False, root_rank, name, process_set)


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start overwriting ``tensor`` with ``root_rank``'s, in place."""
    return _start_broadcast(tensor, True, root_rank, name, process_set)


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s, in place; returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root: int, name: str | None) -> torch.Tensor:  # type: ignore[override]
        ctx.root = root
        return synchronize(broadcast_async(tensor, root, name))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        reduced = allreduce(grad, op=Sum)
        if basics.rank() != ctx.root:
            reduced = reduced * 0
        return reduced, None, None


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """``root_rank``'s ``tensor`` on every rank (a new tensor; differentiable)."""
    check_process_set(process_set)
    return _Broadcast.apply(tensor, root_rank, name)


# -- alltoall ---------------------------------------------------------------------------------


def _splits(tensor: torch.Tensor, splits: Any) -> tuple[int, ...]:
    world = basics.size()
    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension; got a scalar")
    rows = tensor.shape[0]
    if splits is None:
        if rows % world:
            raise ValueError(
                f"alltoall without splits divides dim 0 evenly, but {rows} rows do not split "
                f"over {world} ranks; pass splits=[rows for rank 0, rank 1, ...]"
            )
        return (rows // world,) * world
    values = tuple(int(s) for s in (splits.tolist() if torch.is_tensor(splits) else splits))
    if len(values) != world or any(s < 0 for s in values) or sum(values) != rows:
        raise ValueError(
            f"alltoall splits {list(values)} must be {world} non-negative counts that sum to "
            f"the {rows} rows of the tensor"
        )
    return values


def alltoall_async(
    tensor: torch.Tensor,
    splits: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start sending ``splits[r]`` rows to rank r; yields (output, received_splits)."""
    check_process_set(process_set)
    chosen = _splits(tensor, splits)
    return register([submit(ALLTOALL, tensor, name, None, splits=chosen)])


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None
    ) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        output, received = synchronize(alltoall_async(tensor, splits, name))
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> tuple[Any, ...]:  # type: ignore[override]
        back, _received = alltoall(grad.contiguous(), splits=ctx.received)
        return back, None, None


def alltoall(
    tensor: torch.Tensor,
    splits: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Scatter rows to every rank and gather theirs; with ``splits`` also returns the
    received splits (Horovod's return convention). Differentiable."""
    check_process_set(process_set)
    output, received = _Alltoall.apply(tensor, splits, name)
    return output if splits is None else (output, received)


# -- reducescatter ----------------------------------------------------------------------------


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: ReduceOp = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Start reducing ``tensor`` and giving rank r its share of dim 0 (first ranks get one
    more row when it does not divide)."""
    check_process_set(process_set)
    reduce_op = resolve_op(op, None)
    if reduce_op not in (Average, Sum):
        raise ValueError(f"reducescatter supports op=hvd.Average or hvd.Sum, got {reduce_op.name}")
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    check_scales(tensor, prescale_factor, postscale_factor)
    work = submit(
        REDUCESCATTER,
        tensor,
        name,
        None,
        op=int(reduce_op),
        prescale=float(prescale_factor),
        postscale=float(postscale_factor),
    )
    return register([work])


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        name: str | None,
        op: ReduceOp,
        pre: float,
        post: float,
    ) -> torch.Tensor:  # type: ignore[override]
        ctx.op, ctx.scale = op, pre * post
        return synchronize(reducescatter_async(tensor, name, op, None, pre, post))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        full = allgather(grad.contiguous()) * ctx.scale
        if ctx.op == Average:
            full = full / basics.size()
        return full, None, None, None, None


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """This rank's share of ``tensor`` reduced across ranks (differentiable)."""
    check_process_set(process_set)
    compressed, ctx = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, name, op, prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)
