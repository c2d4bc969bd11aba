"""``sparse_allreduce_async``: Horovod's reduction of a sparse COO tensor.

As in Horovod, the indices and the values are allgathered (under ``<name>.indices`` and
``<name>.values``) and the result is a sparse tensor holding every rank's entries (duplicate
indices are summed when it is coalesced); ``Average`` divides the values by the process set's
size. The returned handle is a callable; ``hvd.synchronize(handle)`` calls it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from longboat.horovod.torch.ops import (
    Average,
    ProcessSet,
    controller,
    global_process_set,
    set_size,
    synchronize,
)
from longboat.horovod.torch.requests import ReduceOp
from longboat.horovod.torch.scatter_gather import allgather_async


def sparse_allreduce_async(
    tensor: torch.Tensor,
    name: str | None,
    op: ReduceOp = Average,
    process_set: ProcessSet = global_process_set,
) -> Callable[[], torch.Tensor]:
    """Start reducing the sparse ``tensor``; the returned callable waits and gives the result."""
    if not tensor.is_sparse:
        raise ValueError("sparse_allreduce_async needs a sparse COO tensor")
    if ReduceOp(int(op)) not in (ReduceOp.Average, ReduceOp.Sum):
        raise ValueError(f"sparse allreduce supports op=hvd.Average or hvd.Sum, got {op}")
    base = controller(process_set).name_for("sparse_allreduce", name)
    indices = allgather_async(tensor._indices().t().contiguous(), f"{base}.indices", process_set)
    values = allgather_async(tensor._values(), f"{base}.values", process_set)
    size = set_size(process_set)

    def handle() -> torch.Tensor:
        gathered_values = synchronize(values)
        gathered_indices = synchronize(indices)
        if ReduceOp(int(op)) == ReduceOp.Average:
            gathered_values = gathered_values / size
        return torch.sparse_coo_tensor(
            gathered_indices.t(), gathered_values, tensor.shape, dtype=gathered_values.dtype
        )

    return handle
