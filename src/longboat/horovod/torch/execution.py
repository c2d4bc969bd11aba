"""The collectives the negotiation thread runs once every rank agreed on a name.

Ready allreduces are fused by the core's bucket planner and summed with the core's allreduce
algorithm; broadcasts travel coalesced through the core's ``broadcast_state``; allgather,
alltoall and reducescatter run on the data group. A joined rank contributes zeros to
allreduces (the other collectives are refused while a rank has joined, as in Horovod).
Tensors travel in a dtype Gloo supports (``dtypes.py``). An op that fails here fails on the
ranks that submitted it, and the negotiation goes on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from longboat.collective.buckets import MB, GradSpec, plan_buckets
from longboat.collective.consistency import broadcast_state
from longboat.comm.streams import WorkerStreams
from longboat.horovod.torch.dtypes import scale, unwire, wire
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
    _streams: WorkerStreams  # the negotiation thread's side streams (GPU)

    def _local(self, name: str) -> Work | None:
        raise NotImplementedError

    def _done(self, name: str, result: Any = None, error: BaseException | None = None) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def _after_submitters(self, responses: list[Response]) -> Iterator[None]:
        """On a GPU, run on this thread's side stream once it has waited for every submitting
        stream's position (the kernels that wrote the inputs); a no-op on the CPU."""
        with contextlib.ExitStack() as stack:
            for resp in responses:
                work = self._local(resp.name)
                if work is not None and work.handoff is not None:
                    stack.enter_context(self._streams.running(work.handoff))
            yield

    def _execute(self, responses: list[Response]) -> None:
        """Run ``responses`` (the same list on every rank) after their submitting streams:
        disagreements fail, allreduces fuse by dtype, device, op and scales, broadcasts by
        root, the rest run one by one."""
        with self._after_submitters(responses):
            self._run_responses(responses)

    def _run_responses(self, responses: list[Response]) -> None:
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
            self._guarded(group, self._allreduce, group)
        for root, group in broadcasts.items():
            self._guarded(group, self._broadcast, root, group)
        for resp in responses:
            if resp.error is None and resp.first.kind not in (ALLREDUCE, BROADCAST):
                self._guarded([resp], getattr(self, "_" + resp.first.kind.lower()), resp)

    def _guarded(self, group: list[Response], run: Callable[..., None], *args: Any) -> None:
        """``run(*args)``; if it raises, the ops of ``group`` still open here fail with the
        reason and the next responses run as usual."""
        try:
            run(*args)
        except Exception as exc:  # noqa: BLE001 - delivered to the op's waiters
            for resp in group:
                q = resp.first
                self._done(
                    resp.name,
                    error=HorovodInternalError(
                        f"rank {self.rank}: {q.kind} {resp.name!r} ({q.dtype} "
                        f"{list(q.shape)}) failed: {type(exc).__name__}: {exc}"
                    ),
                )

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

    def _reduce(self, flat: torch.Tensor, q: Request) -> Any:
        """Start reducing ``flat`` (a fresh wire-dtype copy): prescale, then the collective.
        Returns ``(tensor, handle)``: the tensor the collective fills."""
        flat = scale(flat, q.prescale)
        return flat, self._start_reduce(flat, q.op)

    def _finish_reduce(self, flat: torch.Tensor, q: Request) -> torch.Tensor:
        """Postscale (and Average's ``1 / size``) as Horovod: float64 for integers."""
        factor = q.postscale / self.world if q.op == ReduceOp.Average else q.postscale
        return scale(flat, factor)

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
            launched.append((members, *self._reduce(wire(flat, reduce=True), q)))
        for members, flat, handle in launched:
            handle.wait()
            flat = unwire(self._finish_reduce(flat, q), inputs[0].dtype)
            pieces = flat.split([inputs[i].numel() for i in members])
            for i, piece in zip(members, pieces, strict=True):
                work = self._local(group[i].name)
                if work is not None:
                    out = work.output
                    out.copy_(piece.view(out.shape))
                    self._done(group[i].name, out)

    def _broadcast(self, root: int, group: list[Response]) -> None:
        targets = []
        for resp in group:
            work = self._local(resp.name)
            targets.append(work.output if work is not None else self._input(resp))
        wired = [wire(t, reduce=False) for t in targets]
        broadcast_state(wired, group=self.data, src=root, coalesce=True)
        for resp, target, sent in zip(group, targets, wired, strict=True):
            if sent is not target:
                target.copy_(sent)
            self._done(resp.name, target)

    def _allgather(self, resp: Response) -> None:
        original = self._input(resp)
        mine = wire(original, reduce=False)
        rows = [resp.requests[r].shape[0] if r in resp.requests else 0 for r in range(self.world)]
        padded = mine.new_zeros((max(rows), *mine.shape[1:]))
        padded[: mine.shape[0]] = mine
        gathered = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(gathered, padded, group=self.data)
        out = torch.cat([g[:n] for g, n in zip(gathered, rows, strict=True)])
        self._done(resp.name, unwire(out, original.dtype))

    def _alltoall(self, resp: Response) -> None:
        work = self._local(resp.name)
        original = self._input(resp)
        mine = wire(original, reduce=False)
        send = list(resp.requests[self.rank].splits) if work is not None else [0] * self.world
        recv = [
            resp.requests[r].splits[self.rank] if r in resp.requests else 0
            for r in range(self.world)
        ]
        out = mine.new_empty((sum(recv), *mine.shape[1:]))
        dist.all_to_all_single(out, mine.contiguous(), recv, send, group=self.data)
        received = torch.tensor(recv, dtype=torch.int32)
        self._done(resp.name, (unwire(out, original.dtype), received))

    def _reducescatter(self, resp: Response) -> None:
        q = resp.first
        original = self._input(resp)
        flat, handle = self._reduce(wire(original.reshape(-1).clone(), reduce=True), q)
        handle.wait()
        flat = unwire(self._finish_reduce(flat, q), original.dtype)
        rows = scatter_rows(q.shape[0], self.world)
        start = sum(rows[: self.rank])
        full = flat.view(q.shape)
        self._done(resp.name, full[start : start + rows[self.rank]].clone())

    def _barrier(self, resp: Response) -> None:
        self._done(resp.name, None)  # every rank submitted it: that is the barrier
