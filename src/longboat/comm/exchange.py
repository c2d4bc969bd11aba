"""Exchange small byte strings between ranks as tensors (never pickle what a peer sent)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from longboat.cluster.backends import runs_on_device

_bound_device: torch.device | None = None


def bind_device(device: torch.device) -> None:
    """This rank's GPU, as ``lb.distribute`` found it on the model: where control tensors go
    when the group itself names no device."""
    global _bound_device
    _bound_device = device if device.type == "cuda" else None


def control_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where the tensors of ``group``'s small control collectives live.

    The CPU under Gloo. Under NCCL, which has no CPU collectives, this rank's GPU: the one the
    group was bound to (``init_process_group(device_id=...)``), else the one this rank's model
    lives on (:func:`bind_device`), else the current CUDA device. A group a user initialised
    without ``torch.cuda.set_device`` would otherwise exchange on GPU 0 from every rank.
    """
    if not runs_on_device(dist.get_backend(group)):
        return torch.device("cpu")
    pg = group if group is not None else dist.group.WORLD
    bound = getattr(pg, "bound_device_id", None)
    if bound is not None:
        return bound
    if _bound_device is not None:
        return _bound_device
    return torch.device("cuda", torch.cuda.current_device())


def any_rank(flag: bool, group: dist.ProcessGroup | None = None) -> bool:
    """Collective: is ``flag`` true on any rank of ``group``? Every rank gets the same answer
    (one MAX allreduce of one integer; the host waits for it)."""
    value = torch.tensor([int(flag)], device=control_device(group))
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def allgather_bytes(data: bytes, group: dist.ProcessGroup | None = None) -> list[bytes]:
    """Every rank's ``data``, indexed by rank in ``group``; sizes may differ between ranks."""
    device = control_device(group)
    world = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    if data:
        padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return [bytes(t[:n].cpu().numpy().tobytes()) for t, n in zip(gathered, lengths, strict=True)]
