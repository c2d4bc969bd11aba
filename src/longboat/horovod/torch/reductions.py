"""Horovod's reductions: allreduce and grouped allreduce, in place or not, async or not.

Each op is submitted by name to the negotiation thread and returns a handle (``ops.py``).
The differentiable forms define gradients for the sum of every rank's loss, as Horovod does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from longboat.horovod.torch.compression import Compression, Compressor
from longboat.horovod.torch.ops import (
    ProcessSet,
    controller,
    global_process_set,
    register,
    resolve_op,
    submit,
    synchronize,
)
from longboat.horovod.torch.requests import ALLREDUCE, ReduceOp, Work


def _allreduce_work(
    tensor: torch.Tensor,
    output: torch.Tensor,
    name: str | None,
    op: ReduceOp,
    prescale: float,
    postscale: float,
    process_set: ProcessSet | None,
) -> Work:
    return submit(
        ALLREDUCE,
        tensor,
        name,
        output,
        process_set,
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
    reduce_op = resolve_op(op, average, stacklevel=4)  # warn at the caller of *_async(_)
    outputs = tensors if in_place else [_fresh(t) for t in tensors]
    if grouped:
        works = _grouped_works(tensors, outputs, name, reduce_op, pre, post, process_set)
        return register(works, grouped=True)
    work = _allreduce_work(tensors[0], outputs[0], name, reduce_op, pre, post, process_set)
    return register([work])


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
        [tensor],
        False,
        False,
        average,
        name,
        op,
        prescale_factor,
        postscale_factor,
        process_set,
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
        [tensor],
        True,
        False,
        average,
        name,
        op,
        prescale_factor,
        postscale_factor,
        process_set,
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


class _ReduceCtx(Protocol):
    """What the allreduce Functions' forward keeps for the backward (autograd's ctx): the
    backward reduces the gradients with the same op, scaling and process set."""

    op: ReduceOp
    pre: float
    post: float
    process_set: ProcessSet


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: _ReduceCtx,
        tensor: torch.Tensor,
        name: str | None,
        op: ReduceOp,
        pre: float,
        post: float,
        process_set: ProcessSet,
    ) -> torch.Tensor:
        ctx.op, ctx.pre, ctx.post, ctx.process_set = op, pre, post, process_set
        return synchronize(allreduce_async(tensor, None, name, op, pre, post, process_set))

    @staticmethod
    def backward(ctx: _ReduceCtx, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = allreduce(
            grad,
            op=ctx.op,
            prescale_factor=ctx.pre,
            postscale_factor=ctx.post,
            process_set=ctx.process_set,
        )
        return reduced, None, None, None, None, None


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
    reduce_op = resolve_op(op, average)
    compressed, ctx = compression.compress(tensor)
    reduced = _Allreduce.apply(
        compressed, name, reduce_op, prescale_factor, postscale_factor, process_set
    )
    return compression.decompress(reduced, ctx)


# -- grouped allreduce ------------------------------------------------------------------------


def _grouped_works(
    tensors: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    name: str | None,
    op: ReduceOp,
    pre: float,
    post: float,
    process_set: ProcessSet | None,
) -> list[Work]:
    if not tensors:
        raise ValueError("grouped allreduce needs at least one tensor")
    base = controller(process_set).name_for("grouped_allreduce", name)
    return [
        _allreduce_work(t, o, f"{base}.{i}", op, pre, post, process_set)
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
        tensors,
        False,
        True,
        average,
        name,
        op,
        prescale_factor,
        postscale_factor,
        process_set,
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
        tensors,
        True,
        True,
        average,
        name,
        op,
        prescale_factor,
        postscale_factor,
        process_set,
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
    def forward(
        ctx: _ReduceCtx,
        name: str | None,
        op: ReduceOp,
        pre: float,
        post: float,
        process_set: ProcessSet,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.op, ctx.pre, ctx.post, ctx.process_set = op, pre, post, process_set
        handle = grouped_allreduce_async(list(tensors), None, name, op, pre, post, process_set)
        return tuple(synchronize(handle))

    @staticmethod
    def backward(ctx: _ReduceCtx, *grads: torch.Tensor) -> tuple[Any, ...]:
        reduced = grouped_allreduce(
            list(grads),
            op=ctx.op,
            prescale_factor=ctx.pre,
            postscale_factor=ctx.post,
            process_set=ctx.process_set,
        )
        return (None, None, None, None, None, *reduced)


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
    reduce_op = resolve_op(op, average)
    packed = [compression.compress(t) for t in tensors]
    reduced = _GroupedAllreduce.apply(
        name, reduce_op, prescale_factor, postscale_factor, process_set, *(t for t, _ in packed)
    )
    return [compression.decompress(t, c) for t, (_, c) in zip(reduced, packed, strict=True)]
