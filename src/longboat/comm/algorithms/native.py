"""native: torch.distributed's own allreduce (Gloo's or NCCL's) on the communicator."""

from __future__ import annotations

import torch
import torch.distributed as dist

from longboat.cluster.backends import runs_on_device
from longboat.comm.algorithms import AllreduceFn, Done, Handle, Network, Parts, register


def cost(nbytes: float, net: Network) -> Parts:
    """The backend's own allreduce: NCCL's choice on GPUs, Gloo's tree-like one on hosts."""
    return net.nccl(nbytes, None) if net.on_device else net.flat(nbytes, "tree")


@register("native", topologies=("any",), cost=cost)
def make_native(group: dist.ProcessGroup) -> AllreduceFn:
    """Asynchronous in-place SUM allreduce through the backend's own algorithm."""
    # One rank: nothing to exchange on Gloo. On NCCL the allreduce is still launched (a
    # device-side no-op for an in-place single-rank sum) so that one GPU runs, and measures,
    # the same stream hand-offs as N GPUs do.
    single = dist.get_world_size(group) == 1 and not runs_on_device(dist.get_backend(group))
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.SUM

    def allreduce(tensor: torch.Tensor) -> Handle:
        if single or tensor.numel() == 0:
            return Done()
        # the process group's own method: same collective, without the Python-level checks
        # dist.all_reduce repeats on every call (this is the per-bucket hot path)
        return group.allreduce([tensor], options)

    return allreduce
