"""Horovod's ops that move rows between ranks: allgather, broadcast, alltoall, reducescatter,
and the grouped allgather / reducescatter.

Sizes may differ per rank where Horovod allows it (allgather rows, alltoall splits). Like the
reductions, each returns a handle or, in its differentiable form, a tensor. Gradients follow
Horovod's conventions: allgather and broadcast average the incoming gradients over the process
set (broadcast's only reach the root); reducescatter allgathers them, times the set's size for
``Sum``; alltoall sends them back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from longboat.horovod.torch.compression import Compression, Compressor
from longboat.horovod.torch.ops import (
    Average,
    ProcessSet,
    Sum,
    controller,
    global_process_set,
    register,
    resolve_op,
    set_rank,
    set_size,
    submit,
    synchronize,
)
from longboat.horovod.torch.reductions import allreduce, grouped_allreduce
from longboat.horovod.torch.requests import (
    ALLGATHER,
    ALLTOALL,
    BROADCAST,
    REDUCESCATTER,
    ReduceOp,
    Work,
)

# -- allgather --------------------------------------------------------------------------------


def _allgather_work(tensor: torch.Tensor, name: str | None, process_set: Any) -> Work:
    if tensor.dim() == 0:
        raise ValueError("allgather needs a tensor with at least one dimension; got a scalar")
    return submit(ALLGATHER, tensor, name, None, process_set)


def _group_base(kind: str, tensors: Sequence[torch.Tensor], name: str | None, ps: Any) -> str:
    if not tensors:
        raise ValueError(f"grouped {kind} needs at least one tensor")
    return controller(ps).name_for(f"grouped_{kind}", name)


def allgather_async(
    tensor: torch.Tensor,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start concatenating every rank's ``tensor`` along dim 0 (sizes may differ)."""
    return register([_allgather_work(tensor, name, process_set)])


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start allgathering each tensor (negotiated as one group); the handle yields a list."""
    base = _group_base("allgather", tensors, name, process_set)
    works = [_allgather_work(t, f"{base}.{i}", process_set) for i, t in enumerate(tensors)]
    return register(works, grouped=True)


def _own_rows(grads: list[torch.Tensor], rows: list[int], process_set: Any) -> list[torch.Tensor]:
    """Each gradient narrowed to this rank's rows (``rows``: this rank's row count per tensor)."""
    counts = allgather(torch.tensor([rows], dtype=torch.int64), process_set=process_set)
    offsets = counts[: set_rank(process_set)].sum(dim=0).tolist()
    return [g.narrow(0, int(o), n) for g, o, n in zip(grads, offsets, rows, strict=True)]


class _AllgatherCtx(Protocol):
    """What `_Allgather`'s forward keeps for its backward (autograd's ctx)."""

    rows: list[int]
    ps: ProcessSet


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: _AllgatherCtx, name: str | None, grouped: bool, ps: Any, *tensors: torch.Tensor
    ) -> Any:
        ctx.rows, ctx.ps = [t.shape[0] for t in tensors], ps
        if not grouped:
            return synchronize(allgather_async(tensors[0], name, ps))
        return tuple(synchronize(grouped_allgather_async(list(tensors), name, ps)))

    @staticmethod
    def backward(ctx: _AllgatherCtx, *grads: torch.Tensor) -> tuple[Any, ...]:
        reduced = grouped_allreduce([g.contiguous() for g in grads], op=Average, process_set=ctx.ps)
        return (None, None, None, *_own_rows(reduced, ctx.rows, ctx.ps))


def allgather(
    tensor: torch.Tensor,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0 in rank order (differentiable)."""
    return _Allgather.apply(name, False, process_set, tensor)


def grouped_allgather(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Each tensor allgathered, negotiated as one group (differentiable)."""
    return list(_Allgather.apply(name, True, process_set, *tensors))


# -- broadcast --------------------------------------------------------------------------------


def _local_root(root_rank: int, process_set: Any) -> int:
    """``root_rank`` (a global rank, as in Horovod) as a position in ``process_set``."""
    ctl = controller(process_set)
    members = (
        list(range(ctl.world))
        if process_set is None or process_set is global_process_set
        else list(process_set.ranks)
    )
    if int(root_rank) not in members:
        raise ValueError(f"root_rank={root_rank} is not a rank of {process_set} ({members})")
    return members.index(int(root_rank))


def _start_broadcast(
    tensor: torch.Tensor,
    in_place: bool,
    root_rank: int,
    name: str | None,
    process_set: Any,
) -> int:
    """broadcast_async(_): into ``tensor`` itself (``in_place``) or into a new tensor."""
    root = _local_root(root_rank, process_set)
    output = tensor.data if in_place else tensor.detach().clone()
    return register([submit(BROADCAST, tensor, name, output, process_set, root=root)])


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


class _BroadcastCtx(Protocol):
    """What `_Broadcast`'s forward keeps for its backward (autograd's ctx)."""

    root: int
    ps: ProcessSet


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: _BroadcastCtx, tensor: torch.Tensor, root: int, name: str | None, ps: Any
    ) -> torch.Tensor:
        ctx.root, ctx.ps = _local_root(root, ps), ps
        return synchronize(broadcast_async(tensor, root, name, ps))

    @staticmethod
    def backward(ctx: _BroadcastCtx, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = allreduce(grad, op=Average, process_set=ctx.ps)
        if set_rank(ctx.ps) != ctx.root:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """``root_rank``'s ``tensor`` on every rank (a new tensor; differentiable)."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


# -- alltoall ---------------------------------------------------------------------------------


def _splits(tensor: torch.Tensor, splits: Any, process_set: Any) -> tuple[int, ...]:
    world = set_size(process_set)
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
    chosen = _splits(tensor, splits, process_set)
    return register([submit(ALLTOALL, tensor, name, None, process_set, splits=chosen)])


class _AlltoallCtx(Protocol):
    """What `_Alltoall`'s forward keeps for its backward (autograd's ctx)."""

    received: torch.Tensor
    ps: ProcessSet

    def mark_non_differentiable(self, *args: torch.Tensor) -> None: ...


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: _AlltoallCtx, tensor: torch.Tensor, splits: Any, name: str | None, ps: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        output, received = synchronize(alltoall_async(tensor, splits, name, ps))
        ctx.received, ctx.ps = received, ps
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: _AlltoallCtx, grad: torch.Tensor, _: Any) -> tuple[Any, ...]:
        back, _received = alltoall(grad.contiguous(), splits=ctx.received, process_set=ctx.ps)
        return back, None, None, None


def alltoall(
    tensor: torch.Tensor,
    splits: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Scatter rows to every rank and gather theirs; with ``splits`` also returns the
    received splits (Horovod's return convention). Differentiable."""
    output, received = _Alltoall.apply(tensor, splits, name, process_set)
    return output if splits is None else (output, received)


# -- reducescatter ----------------------------------------------------------------------------


def _reducescatter_work(
    tensor: torch.Tensor,
    name: str | None,
    op: ReduceOp,
    process_set: Any,
    pre: float,
    post: float,
) -> Work:
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    return submit(
        REDUCESCATTER,
        tensor,
        name,
        None,
        process_set,
        op=int(op),
        prescale=float(pre),
        postscale=float(post),
    )


def _scatter_op(op: Any) -> ReduceOp:
    reduce_op = resolve_op(op, None, stacklevel=4)
    if reduce_op not in (Average, Sum):
        raise ValueError(f"reducescatter supports op=hvd.Average or hvd.Sum, got {reduce_op.name}")
    return reduce_op


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
    reduce_op = _scatter_op(op)
    work = _reducescatter_work(
        tensor, name, reduce_op, process_set, prescale_factor, postscale_factor
    )
    return register([work])


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: ReduceOp = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Start reducescattering each tensor (negotiated as one group); the handle yields a list."""
    reduce_op = _scatter_op(op)
    base = _group_base("reducescatter", tensors, name, process_set)
    works = [
        _reducescatter_work(
            t, f"{base}.{i}", reduce_op, process_set, prescale_factor, postscale_factor
        )
        for i, t in enumerate(tensors)
    ]
    return register(works, grouped=True)


class _ReducescatterCtx(Protocol):
    """What `_Reducescatter`'s forward keeps for its backward (autograd's ctx)."""

    op: ReduceOp
    scale: float
    ps: ProcessSet


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: _ReducescatterCtx,
        name: str | None,
        grouped: bool,
        op: ReduceOp,
        ps: Any,
        pre: float,
        post: float,
        *tensors: torch.Tensor,
    ) -> Any:
        ctx.op, ctx.scale, ctx.ps = op, pre * post, ps
        if not grouped:
            return synchronize(reducescatter_async(tensors[0], name, op, ps, pre, post))
        handle = grouped_reducescatter_async(list(tensors), name, op, ps, pre, post)
        return tuple(synchronize(handle))

    @staticmethod
    def backward(ctx: _ReducescatterCtx, *grads: torch.Tensor) -> tuple[Any, ...]:
        gathered = grouped_allgather([g.contiguous() for g in grads], process_set=ctx.ps)
        factor = ctx.scale * (set_size(ctx.ps) if ctx.op == Sum else 1)
        return (None, None, None, None, None, None, *(g * factor for g in gathered))


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
    compressed, ctx = compression.compress(tensor)
    out = _Reducescatter.apply(
        name, False, _scatter_op(op), process_set, prescale_factor, postscale_factor, compressed
    )
    return compression.decompress(out, ctx)


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """Each tensor's share reduced across ranks, negotiated as one group (differentiable)."""
    packed = [compression.compress(t) for t in tensors]
    out = _Reducescatter.apply(
        name,
        True,
        _scatter_op(op),
        process_set,
        prescale_factor,
        postscale_factor,
        *(t for t, _ in packed),
    )
    return [compression.decompress(t, c) for t, (_, c) in zip(out, packed, strict=True)]
