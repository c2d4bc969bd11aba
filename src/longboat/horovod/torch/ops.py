"""Horovod's collectives with Horovod's signatures: async handles, poll/synchronize, autograd.

Every op is submitted by name to the negotiation thread (``negotiation.py``) and returns an
integer handle; ``synchronize(handle)`` waits for the result (bounded by the job timeout) and
raises :class:`HorovodInternalError` with the reason when the op failed. The differentiable
forms (``allreduce``, ``allgather``, ``broadcast``, ``alltoall``, ``reducescatter``,
``grouped_allreduce``) define gradients for the sum of every rank's loss, as Horovod does.
"""

from __future__ import annotations

import itertools
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from longboat.horovod.torch import basics
from longboat.horovod.torch.compression import Compression, Compressor
from longboat.horovod.torch.negotiation import (
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    BARRIER,
    BROADCAST,
    REDUCESCATTER,
    HorovodInternalError,
    ReduceOp,
    Request,
    Work,
    scatter_rows,
)

Average, Sum, Adasum = ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum
Min, Max, Product = ReduceOp.Min, ReduceOp.Max, ReduceOp.Product


class ProcessSet:
    """Horovod's process set; only the global one (every rank) exists here."""

    def __repr__(self) -> str:
        return "ProcessSet(global)"


global_process_set = ProcessSet()


@dataclass
class _Handle:
    works: list[Work]
    grouped: bool = False


_handles: dict[int, _Handle] = {}  # this Horovod session's outstanding ops, by handle
_handles_lock = threading.Lock()
_next_handle = itertools.count()


def reset_handles() -> None:
    """Forget every outstanding handle (``hvd.shutdown``). Numbers keep counting up, so a
    handle kept from an old session can never match a new session's op."""
    with _handles_lock:
        _handles.clear()


def _check_process_set(process_set: Any) -> None:
    if process_set is not None and process_set is not global_process_set:
        raise NotImplementedError(
            "longboat.horovod runs every op on all ranks: pass no process_set "
            "(hvd.global_process_set)"
        )


def _register(works: list[Work], grouped: bool = False) -> int:
    with _handles_lock:
        handle = next(_next_handle)
        _handles[handle] = _Handle(works, grouped)
    return handle


def resolve_op(op: Any, average: bool | None, stacklevel: int = 3) -> ReduceOp:
    """Horovod's rule: ``op`` supersedes the deprecated ``average``; default Average.

    ``stacklevel`` points the deprecation warning at the user's call (3: the caller's caller).
    """
    if op is not None:
        if average is not None:
            raise ValueError(
                "The op parameter supersedes average. Please provide only one of them."
            )
        chosen = ReduceOp(int(op))
    elif average is not None:
        warnings.warn(
            "Parameter `average` has been replaced with `op` and will be removed",
            DeprecationWarning,
            stacklevel=stacklevel,
        )
        chosen = Average if average else Sum
    else:
        chosen = Average
    if chosen == Adasum:
        raise NotImplementedError(
            "op=hvd.Adasum is not implemented in longboat.horovod; use op=hvd.Average "
            "(the default) or hvd.Sum"
        )
    return chosen


def _submit(
    kind: str, tensor: torch.Tensor | None, name: str | None, out: Any, **extra: Any
) -> Work:
    ctl = basics.controller()
    request = Request.of(ctl.name_for(kind, name), kind, tensor, **extra)
    source = None if tensor is None else tensor.detach()
    return ctl.submit(Work(request, source, out))


def _check_scales(tensor: torch.Tensor, prescale: float, postscale: float) -> None:
    if (prescale != 1.0 or postscale != 1.0) and not tensor.is_floating_point():
        raise ValueError(
            f"prescale_factor/postscale_factor need a floating-point tensor, got {tensor.dtype}"
        )


def _allreduce_work(
    tensor: torch.Tensor,
    output: torch.Tensor,
    name: str | None,
    op: ReduceOp,
    prescale: float,
    postscale: float,
) -> Work:
    _check_scales(tensor, prescale, postscale)
    return _submit(
        ALLREDUCE,
        tensor,
        name,
        output,
        op=int(op),
        prescale=float(prescale),
        postscale=float(postscale),
    )


def _fresh(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)


def _start_allreduce(
    tensors: Sequence[torch.Tensor],
    in_place: bool,
    grouped: bool,
    average: bool | None,
    name: str | None,
    op: ReduceOp | None,
    pre: float,
    post: float,
    process_set: Any,
) -> int:
    """The four allreduce_async variants: ``tensors`` reduced into themselves (``in_place``)
    or into new tensors, as one op (``[tensor]``) or as one named group (``grouped``)."""
    _check_process_set(process_set)
    reduce_op = resolve_op(op, average, stacklevel=4)  # warn at the caller of *_async(_)
    outputs = tensors if in_place else [_fresh(t) for t in tensors]
    if grouped:
        works = _grouped_works(tensors, outputs, name, reduce_op, pre, post)
        return _register(works, grouped=True)
    return _register([_allreduce_work(tensors[0], outputs[0], name, reduce_op, pre, post)])


# -- allreduce ------------------------------------------------------------------------------


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start reducing ``tensor`` across ranks into a new tensor; returns a handle."""
    return _start_allreduce(
        [tensor], False, False, average, name, op, prescale_factor, postscale_factor, process_set
    )


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start reducing ``tensor`` in place; returns a handle."""
    return _start_allreduce(
        [tensor], True, False, average, name, op, prescale_factor, postscale_factor, process_set
    )


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduce ``tensor`` across ranks in place and return it."""
    return synchronize(
        allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    )


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp, pre: float, post: float
    ) -> torch.Tensor:
        ctx.op, ctx.pre, ctx.post = op, pre, post
        return synchronize(allreduce_async(tensor, None, name, op, pre, post))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        reduced = allreduce(grad, op=ctx.op, prescale_factor=ctx.pre, postscale_factor=ctx.post)
        return reduced, None, None, None, None


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """``tensor`` reduced across ranks (a new tensor; differentiable)."""
    _check_process_set(process_set)
    reduce_op = resolve_op(op, average)
    compressed, ctx = compression.compress(tensor)
    reduced = _Allreduce.apply(compressed, name, reduce_op, prescale_factor, postscale_factor)
    return compression.decompress(reduced, ctx)


# -- grouped allreduce ------------------------------------------------------------------------


def _grouped_works(
    tensors: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    name: str | None,
    op: ReduceOp,
    pre: float,
    post: float,
) -> list[Work]:
    if not tensors:
        raise ValueError("grouped allreduce needs at least one tensor")
    base = basics.controller().name_for("grouped_allreduce", name)
    return [
        _allreduce_work(t, o, f"{base}.{i}", op, pre, post)
        for i, (t, o) in enumerate(zip(tensors, outputs, strict=True))
    ]


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start reducing a list of tensors as one fused group; the handle yields a list."""
    return _start_allreduce(
        tensors, False, True, average, name, op, prescale_factor, postscale_factor, process_set
    )


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start reducing a list of tensors in place as one group."""
    return _start_allreduce(
        tensors, True, True, average, name, op, prescale_factor, postscale_factor, process_set
    )


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Reduce a list of tensors in place; returns them."""
    return synchronize(
        grouped_allreduce_async_(
            tensors, average, name, op, prescale_factor, postscale_factor, process_set
        )
    )


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, name: str | None, op: ReduceOp, pre: float, post: float, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.op, ctx.pre, ctx.post = op, pre, post
        return tuple(synchronize(grouped_allreduce_async(list(tensors), None, name, op, pre, post)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        reduced = grouped_allreduce(
            list(grads), op=ctx.op, prescale_factor=ctx.pre, postscale_factor=ctx.post
        )
        return (None, None, None, None, *reduced)


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Each tensor reduced across ranks, negotiated and fused as one group (differentiable)."""
    _check_process_set(process_set)
    reduce_op = resolve_op(op, average)
    packed = [compression.compress(t) for t in tensors]
    reduced = _GroupedAllreduce.apply(
        name, reduce_op, prescale_factor, postscale_factor, *(t for t, _ in packed)
    )
    return [compression.decompress(t, c) for t, (_, c) in zip(reduced, packed, strict=True)]


# -- allgather --------------------------------------------------------------------------------


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Start concatenating every rank's ``tensor`` along dim 0 (sizes may differ)."""
    _check_process_set(process_set)
    if tensor.dim() == 0:
        raise ValueError("allgather needs a tensor with at least one dimension; got a scalar")
    return _register([_submit(ALLGATHER, tensor, name, None)])


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
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0 in rank order (differentiable)."""
    _check_process_set(process_set)
    return _Allgather.apply(tensor, name)


# -- broadcast --------------------------------------------------------------------------------


def _check_root(root_rank: int) -> int:
    world = basics.size()
    if not 0 <= int(root_rank) < world:
        raise ValueError(f"root_rank={root_rank} is outside 0..{world - 1}")
    return int(root_rank)


def _start_broadcast(
    tensor: torch.Tensor, in_place: bool, root_rank: int, name: str | None, process_set: Any
) -> int:
    """broadcast_async(_): into ``tensor`` itself (``in_place``) or into a new tensor."""
    _check_process_set(process_set)
    root = _check_root(root_rank)
    output = tensor.data if in_place else tensor.detach().clone()
    return _register([_submit(BROADCAST, tensor, name, output, root=root)])


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
    _check_process_set(process_set)
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
    _check_process_set(process_set)
    chosen = _splits(tensor, splits)
    return _register([_submit(ALLTOALL, tensor, name, None, splits=chosen)])


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
    _check_process_set(process_set)
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
    _check_process_set(process_set)
    reduce_op = resolve_op(op, None)
    if reduce_op not in (Average, Sum):
        raise ValueError(f"reducescatter supports op=hvd.Average or hvd.Sum, got {reduce_op.name}")
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    _check_scales(tensor, prescale_factor, postscale_factor)
    work = _submit(
        REDUCESCATTER,
        tensor,
        name,
        None,
        op=int(reduce_op),
        prescale=float(prescale_factor),
        postscale=float(postscale_factor),
    )
    return _register([work])


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp, pre: float, post: float
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
    _check_process_set(process_set)
    compressed, ctx = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, name, op, prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


# -- control ----------------------------------------------------------------------------------


def poll(handle: int) -> bool:
    """True when ``handle``'s op finished (synchronize() then returns at once)."""
    with _handles_lock:
        entry = _handles.get(handle)
    if entry is None:
        raise ValueError(f"unknown or already synchronized handle {handle!r}")
    return all(w.done.is_set() for w in entry.works)


def synchronize(handle: int) -> Any:
    """Wait for ``handle``'s op and return its output (a list for grouped ops)."""
    with _handles_lock:
        entry = _handles.pop(handle, None)
    if entry is None:
        return None
    ctl = basics.controller()
    results = [ctl.wait(w) for w in entry.works]
    return results if entry.grouped else results[0]


def join(device: int = -1) -> int:
    """Declare this rank done; until every rank joined, it contributes zeros to the others'
    allreduces (empty rows to allgathers). Returns the last rank to join."""
    ctl = basics.controller()
    return int(ctl.wait(ctl.join()))


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank reached a barrier (bounded by the job timeout)."""
    _check_process_set(process_set)
    ctl = basics.controller()
    ctl.wait(_submit(BARRIER, None, None, None))


__all__ = [
    "Adasum",
    "Average",
    "HorovodInternalError",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "Sum",
    "allgather",
    "allgather_async",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "global_process_set",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "join",
    "poll",
    "reducescatter",
    "reducescatter_async",
    "scatter_rows",
    "synchronize",
]
