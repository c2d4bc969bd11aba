"""What training holds per rank: optimizer state, gradients and parameters, by tensor.

Counted by tensor storage (each storage once), so it is the same on CPU and GPU; on a GPU the
report adds ``torch.cuda.memory_allocated``. Read it after a step, when the persistent buffers
exist (the first step allocates the optimizer state).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from longboat.sharding.zero.held import state_tensors
from longboat.sharding.zero.step import step_of


@dataclass(frozen=True)
class MemoryReport:
    """Bytes held by this rank."""

    optimizer_state_bytes: int
    gradient_bytes: int
    """Bucket buffers, reduced slices, ``.grad`` tensors outside them."""
    parameter_bytes: int
    device_allocated_bytes: int | None
    """``torch.cuda.memory_allocated`` on a GPU; None on the CPU."""


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes():
            seen[(str(t.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def memory_report(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> MemoryReport:
    """This rank's optimizer-state, gradient and parameter bytes for a model and optimizer
    ``lb.distribute`` returned (or plain ones)."""
    sharded = step_of(optimizer)
    if sharded is not None:
        state = state_tensors(sharded)
    elif optimizer is not None:
        state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    else:
        state = []
    params = [p for p in model.parameters()]
    grads = [p.grad for p in params if p.grad is not None]
    reducer = getattr(model, "reducer", None)
    if reducer is not None:
        grads += [buffer for buffer, _ in reducer.bucket_layouts()]
    if sharded is not None:  # stage 2's slices; zeros standing in for a missing .grad
        grads += sharded.scatter.slices if sharded.scatter is not None else []
        grads += [p.grad for p in sharded.shard_params if p.grad is not None]
    device = params[0].device if params else torch.device("cpu")
    allocated = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    return MemoryReport(
        optimizer_state_bytes=storage_bytes(state),
        gradient_bytes=storage_bytes(grads),
        parameter_bytes=storage_bytes(params),
        device_allocated_bytes=allocated,
    )
