"""auto: pick an allreduce algorithm per tensor size from a short measurement at start-up.

Every candidate that fits the topology (shared memory only inside one node, hierarchical only
across several nodes with several ranks each) is timed on a few sizes; the slowest rank's time
counts (the times are max-reduced, so every rank makes the same choice), and each bucket then
uses the winner for the nearest measured size. The choice is logged on rank 0.
"""

from __future__ import annotations

import bisect
import time
from typing import Any

import torch
import torch.distributed as dist

from longboat.comm.algorithms import AllreduceFn, Handle, make, register
from longboat.comm.exchange import control_device
from longboat.log import get_logger
from longboat.registry import auto_candidates

log = get_logger("longboat.comm")

SIZES = (4 << 10, 256 << 10, 4 << 20, 32 << 20)  # bytes measured
_REPEATS = 3


def candidates(group: dist.ProcessGroup) -> list[str]:
    """Registered algorithms whose declared topologies suit ``group``'s placement, in the
    order of `longboat.registry.auto_candidates` ("native" first: it wins a tie)."""
    import longboat.cluster as cluster

    topo = cluster.topology()
    ranks = [dist.get_global_rank(group, i) for i in range(dist.get_world_size(group))]
    nodes = {topo.node_of[r] for r in ranks}
    return [e.name for e in auto_candidates(len(ranks), len(nodes))]


def _time(fn: AllreduceFn, tensor: torch.Tensor, group: dist.ProcessGroup) -> float:
    fn(tensor).wait()  # warm-up (segments, connections)
    samples = []
    for _ in range(_REPEATS):
        dist.barrier(group=group)
        _finish(tensor)
        start = time.perf_counter()
        fn(tensor).wait()
        _finish(tensor)  # a CUDA wait() only orders the stream: time the work itself
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


@register("auto", broadcast=True)
def make_auto(group: dist.ProcessGroup, **options: Any) -> AllreduceFn:
    """Measure the candidates on ``group`` and dispatch each tensor to the fastest.

    ``options``: the plan's, for the candidates that take them."""
    choices = candidates(group)
    fns = {name: make(name, group, options) for name in choices}
    if len(fns) == 1 or dist.get_world_size(group) == 1:
        return fns["native"]
    device = control_device(group)  # the GPU under NCCL: what its buckets will be
    times = torch.zeros(len(SIZES), len(choices), dtype=torch.float64)
    for i, size in enumerate(SIZES):
        tensor = torch.ones(size // 4, dtype=torch.float32, device=device)
        for j, name in enumerate(choices):
            times[i, j] = _time(fns[name], tensor, group)
    slowest = times.to(device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)  # the same choice everywhere
    winners = [choices[int(j)] for j in slowest.cpu().argmin(dim=1)]
    if dist.get_rank() == 0:
        log.info(
            "auto allreduce: %s",
            ", ".join(f"{_human(s)} -> {w}" for s, w in zip(SIZES, winners, strict=True)),
        )
    return _dispatcher([fns[w] for w in winners])


def _finish(tensor: torch.Tensor) -> None:
    """Wait until the device has done the work queued so far (start-up timing only)."""
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


def _dispatcher(per_size: list[AllreduceFn]) -> AllreduceFn:
    bounds = [(a + b) // 2 for a, b in zip(SIZES, SIZES[1:], strict=False)]

    def allreduce(tensor: torch.Tensor) -> Handle:
        nbytes = tensor.numel() * tensor.element_size()
        return per_size[bisect.bisect_right(bounds, nbytes)](tensor)

    return allreduce


def _human(size: int) -> str:
    return f"{size >> 20} MB" if size >= 1 << 20 else f"{size >> 10} KB"
