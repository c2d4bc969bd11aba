"""The collectives the negotiation thread runs once every rank agreed on a name.

Ready allreduces are fused by the core's bucket planner and summed with the core's allreduce
algorithm; broadcasts travel coalesced through the core's ``broadcast_state``; allgather,
alltoall and reducescatter run on the data group. A joined rank contributes zeros (empty rows).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from longboat.collective.buckets import MB, GradSpec, plan_buckets
from longboat.collective.consistency import broadcast_state
from longboat.horovod.torch.requests import (
    ALLGATHER,
    ALLREDUCE,
    BROADCAST,
    HorovodInternalError,
    ReduceOp,
    Request,
    Response,
    Work,
    scatter_rows,
)

_TORCH_OPS = {
    ReduceOp.Min: dist.ReduceOp.MIN,
    ReduceOp.Max: dist.ReduceOp.MAX,
    ReduceOp.Product: dist.ReduceOp.PRODUCT,
}


class Collectives:
    """Runs agreed responses on ``data``; the negotiation (``Controller``) supplies the
    collaborators declared here and the outstanding work (``_local``/``_done``)."""

    rank: int
    world: int
    data: dist.ProcessGroup
    fusion_bytes: int
    _sum: Callable[[torch.Tensor], Any]

    def _local(self, name: str) -> Work | None:
        raise NotImplementedError

    def _done(self, name: str, result: Any = None, error: BaseException | None = None) -> None:
        raise NotImplementedError

    def _execute(self, responses: list[Response]) -> None:
        """Run ``responses`` (the same list on every rank): disagreements fail, allreduces fuse by
        dtype, device, op and scales, broadcasts by root, the rest run one by one."""
        allreduces: dict[tuple[Any, ...], list[Response]] = {}
        broadcasts: dict[int, list[Response]] = {}
        for resp in responses:
            q = resp.first
            if resp.error is not None:
                self._done(resp.name, error=HorovodInternalError(resp.error))
            elif q.kind == ALLREDUCE:
                key = (q.dtype, q.device, q.op, q.prescale, q.postscale)
                allreduces.setdefault(key, []).append(resp)
            elif q.kind == BROADCAST:
                broadcasts.setdefault(q.root, []).append(resp)
        for group in allreduces.values():
            self._allreduce(group)
        for root, group in broadcasts.items():
            self._broadcast(root, group)
        for resp in responses:
            if resp.error is None and resp.first.kind not in (ALLREDUCE, BROADCAST):
                getattr(self, "_" + resp.first.kind.lower())(resp)

    def _input(self, resp: Response) -> torch.Tensor:
        """This rank's tensor for ``resp``; zeros shaped like the others' on a joined rank."""
        work = self._local(resp.name)
        if work is not None and work.tensor is not None:
            return work.tensor
        q = resp.first
        device = torch.device(q.device)
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        shape = q.shape if q.kind != ALLGATHER else (0, *q.shape[1:])
        return torch.zeros(shape, dtype=getattr(torch, q.dtype), device=device)

    def _start_reduce(self, flat: torch.Tensor, op: int) -> Any:
        if op in (ReduceOp.Sum, ReduceOp.Average):
            return self._sum(flat)
        return dist.all_reduce(flat, op=_TORCH_OPS[ReduceOp(op)], group=self.data, async_op=True)

    def _finish_reduce(self, flat: torch.Tensor, q: Request) -> None:
        if q.op == ReduceOp.Average:
            if flat.is_floating_point() or flat.is_complex():
                flat.mul_(q.postscale / self.world)
                return
            flat.div_(self.world, rounding_mode="floor")
        if q.postscale != 1.0:
            flat.mul_(q.postscale)

    def _allreduce(self, group: list[Response]) -> None:
        """Fused allreduce of responses that share dtype, device, op and scale factors."""
        q = group[0].first
        inputs = [self._input(resp) for resp in group]
        specs = [
            GradSpec(i, resp.name, t.numel(), t.dtype, t.device, resp.name)
            for i, (resp, t) in enumerate(zip(group, inputs, strict=True))
        ]
        cap_mb = max(self.fusion_bytes, 1) / MB
        plan = plan_buckets(
            specs,
            fuse=self.fusion_bytes > 0,
            cap_mb=cap_mb,
            max_layers=len(specs) + 1,
            last_cap_mb=cap_mb,
        )
        launched = []
        for bucket in plan.buckets:
            members = sorted(bucket)
            flat = torch.cat([inputs[i].reshape(-1) for i in members])  # a copy, always
            if q.prescale != 1.0:
                flat.mul_(q.prescale)
            launched.append((members, flat, self._start_reduce(flat, q.op)))
        for members, flat, handle in launched:
            handle.wait()
            self._finish_reduce(flat, q)
            pieces = flat.split([inputs[i].numel() for i in members])
            for i, piece in zip(members, pieces, strict=True):
                work = self._local(group[i].name)
                if work is not None:
                    out = work.output
                    out.copy_(piece.view_as(out))
                    self._done(group[i].name, out)

    def _broadcast(self, root: int, group: list[Response]) -> None:
        tensors = []
        for resp in group:
            work = self._local(resp.name)
            tensors.append(work.output if work is not None else self._input(resp))
        broadcast_state(tensors, group=self.data, src=root, coalesce=True)
        for resp, tensor in zip(group, tensors, strict=True):
            self._done(resp.name, tensor)

    def _allgather(self, resp: Response) -> None:
        mine = self._input(resp)
        rows = [resp.requests[r].shape[0] if r in resp.requests else 0 for r in range(self.world)]
        padded = mine.new_zeros((max(rows), *mine.shape[1:]))
        padded[: mine.shape[0]] = mine
        gathered = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(gathered, padded, group=self.data)
        self._done(resp.name, torch.cat([g[:n] for g, n in zip(gathered, rows, strict=True)]))

    def _alltoall(self, resp: Response) -> None:
        work = self._local(resp.name)
        mine = self._input(resp)
        send = list(resp.requests[self.rank].splits) if work is not None else [0] * self.world
        recv = [
            resp.requests[r].splits[self.rank] if r in resp.requests else 0
            for r in range(self.world)
        ]
        out = mine.new_empty((sum(recv), *mine.shape[1:]))
        dist.all_to_all_single(out, mine.contiguous(), recv, send, group=self.data)
        self._done(resp.name, (out, torch.tensor(recv, dtype=torch.int32)))

    def _reducescatter(self, resp: Response) -> None:
        q = resp.first
        flat = self._input(resp).reshape(-1).clone()
        if q.prescale != 1.0:
            flat.mul_(q.prescale)
        self._start_reduce(flat, q.op).wait()
        self._finish_reduce(flat, q)
        rows = scatter_rows(q.shape[0], self.world)
        start = sum(rows[: self.rank])
        full = flat.view(q.shape)
        self._done(resp.name, full[start : start + rows[self.rank]].clone())

    def _barrier(self, resp: Response) -> None:
        self._done(resp.name, None)  # every rank submitted it: that is the barrier
