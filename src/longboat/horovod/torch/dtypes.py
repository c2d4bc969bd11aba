"""Horovod's dtypes on Gloo, and Horovod's scaling arithmetic.

Horovod accepts int8, uint8, int16, int32, int64, float16, bfloat16, float32, float64 and bool.
Gloo has no int16, so int16 travels as int32 and comes back as int16; bool is reduced as int32
(any non-zero result is True: Sum and Max are "any", Min and Product "all"). Every other dtype
travels as itself.

Scale factors follow Horovod: a floating-point tensor is multiplied in its own dtype; an integer
tensor is multiplied in float64 and cast back, which rounds toward zero. ``Average`` is a
postscale by ``1 / size``, so an integer average also rounds toward zero.
"""

from __future__ import annotations

import torch

SUPPORTED = (
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.bool,
)

_MOVED_AS = {torch.int16: torch.int32}
_REDUCED_AS = {torch.int16: torch.int32, torch.bool: torch.int32}


def check_dtype(tensor: torch.Tensor, what: str) -> None:
    """ValueError for a dtype Horovod does not accept (as Horovod raises)."""
    if tensor.dtype not in SUPPORTED:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED)
        raise ValueError(
            f"{what}: tensor type {tensor.dtype} is not supported (use one of {names})"
        )


def wire(tensor: torch.Tensor, reduce: bool) -> torch.Tensor:
    """``tensor`` in a dtype Gloo handles for a reduction (``reduce``) or a data movement."""
    table = _REDUCED_AS if reduce else _MOVED_AS
    target = table.get(tensor.dtype)
    return tensor if target is None else tensor.to(target)


def unwire(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` (from :func:`wire`) back in ``dtype``; non-zero is True for bool."""
    if tensor.dtype == dtype:
        return tensor
    if dtype == torch.bool:
        return tensor != 0
    return tensor.to(dtype)


def scale(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """``tensor * factor`` as Horovod computes it (integers: in float64, toward zero).

    Floating-point tensors are scaled in place and returned; integers give a new tensor.
    """
    if factor == 1.0:
        return tensor
    if tensor.is_floating_point() or tensor.is_complex():
        return tensor.mul_(factor)
    return (tensor.to(torch.float64) * factor).trunc_().to(tensor.dtype)
