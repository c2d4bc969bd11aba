"""What each `longboat bench train` system holds per rank: optimizer state, gradients and
parameters.

By tensor storage (`longboat.sharding.zero.memory`), the same on CPU and GPU: longboat's
through ``memory_report`` (bucket buffers, reduced slices, ``.grad``); DDP's as ``.grad`` plus
its reducer's buckets when they are not the ``.grad`` storage (``gradient_as_bucket_view`` off:
DDP holds both); ``ZeroRedundancyOptimizer``'s state is its local optimizer's; FSDP2's
(longboat's stage 3 and by hand) by local shard (`train_fsdp`). On a GPU the
bench adds ``torch.cuda`` counters around each system's build and warm-up (`DeviceMemory`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

MB = 1024 * 1024
FIELDS = (
    "optimizer_state_mb",
    "gradient_mb",
    "parameter_mb",
    "device_allocated_mb",
    "device_peak_mb",
)
"""A system's memory columns: tensor accounting, then the GPU's counters (None on a CPU)."""


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's own shard
    return [t for s in local.state.values() for t in s.values() if torch.is_tensor(t)]


def _ddp_bucket_bytes(model: nn.parallel.DistributedDataParallel) -> int:
    """Bytes of DDP's gradient buckets that are not the ``.grad`` tensors' storage."""
    data = model._get_ddp_logging_data()
    if data.get("gradient_as_bucket_view"):
        return 0  # the .grad tensors are views of the buckets: counted with them
    sizes = str(data.get("bucket_sizes", ""))
    return sum(int(s) for s in sizes.split(",") if s.strip())


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int, int]:
    """(optimizer state, gradient, parameter bytes) this rank holds for one system; a
    sharded (FSDP2) parameter by its local shard."""
    from longboat.collective.model import DistributedModel
    from longboat.sharding.zero.memory import memory_report, storage_bytes
    from longboat.tools.bench.train_fsdp import fully_sharded_held, is_fully_sharded

    inner = getattr(model, "_orig_mod", model)  # under torch.compile
    if isinstance(inner, DistributedModel):
        report = memory_report(inner, optimizer)
        return report.optimizer_state_bytes, report.gradient_bytes, report.parameter_bytes
    if is_fully_sharded(inner):
        state_t, grads_t, params_t = fully_sharded_held(inner, optimizer)
        return storage_bytes(state_t), storage_bytes(grads_t), storage_bytes(params_t)
    state = storage_bytes(_state_tensors(optimizer))
    grads = storage_bytes([p.grad for p in inner.parameters() if p.grad is not None])
    if isinstance(inner, nn.parallel.DistributedDataParallel):
        grads += _ddp_bucket_bytes(inner)
    return state, grads, storage_bytes(list(inner.parameters()))


@dataclass
class DeviceMemory:
    """``torch.cuda`` counters around one system's build and warm-up: what it keeps allocated
    afterwards, and its peak above what was allocated before it was built."""

    device: torch.device
    before: int = 0

    def start(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.before = torch.cuda.memory_allocated(self.device)

    def stop(self) -> tuple[int, int]:
        """(bytes kept, peak bytes) since `start`."""
        torch.cuda.synchronize(self.device)
        kept = torch.cuda.memory_allocated(self.device) - self.before
        return kept, torch.cuda.max_memory_allocated(self.device) - self.before


def max_over_ranks(rows: dict[str, list[float | None]]) -> dict[str, dict[str, float | None]]:
    """Each system's memory columns (`FIELDS`, in MB), the largest over the ranks (collective:
    every rank, the same systems in the same order)."""
    names = list(rows)
    table = torch.tensor(
        [[-1.0 if v is None else float(v) for v in rows[n]] for n in names], dtype=torch.float64
    )
    if dist.get_backend() == "nccl":
        table = table.cuda()
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    return {
        name: {f: (None if v < 0 else v / MB) for f, v in zip(FIELDS, row, strict=True)}
        for name, row in zip(names, table.cpu().tolist(), strict=True)
    }
