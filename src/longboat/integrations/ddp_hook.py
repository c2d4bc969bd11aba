"""longboat's allreduce algorithms and compressors as a torch DDP communication hook.

For trainers that wrap the model in ``DistributedDataParallel`` themselves (Hugging Face
``accelerate`` and the ``transformers`` Trainer, Lightning's ``DDPStrategy(ddp_comm_hook=...)``)::

    state, hook = lb.ddp_comm_hook(lb.Strategy(gradient_compression="bf16"))
    ddp_model.register_comm_hook(state, hook)

Each of DDP's buckets is divided by the world size and reduced with the algorithm the Strategy
resolves to on this placement (shared memory on one CPU node, hierarchical across nodes, ring,
native, ``auto``), through its compressor (none, fp16, bf16, PowerSGD), one collective in
flight at a time where ``sync_nccl_allreduce`` asks for it. DDP owns the rest: bucket sizes and
order, communicators, overlap, unused parameters and buffers follow DDP's own arguments, and
the Strategy fields for those are not applied (docs/integrations.md lists which fields this
path honours). DGC is refused: its momentum correction needs longboat's optimizer glue
(``lb.distribute``).

On a GPU the returned future is the collective's own (derived with ``then``), so DDP's copy of
the reduced bucket into ``.grad`` is ordered after the reduction (`longboat.comm.handles`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.futures import Future

import longboat.cluster as cluster
from longboat.collective.plan import CollectivePlan, Placement, resolve
from longboat.comm import algorithms
from longboat.comm.algorithms import AllreduceFn
from longboat.comm.compress import make_compressor
from longboat.comm.handles import completed, future_of, wait_for
from longboat.comm.serial import SerialAllreduce
from longboat.registry import COMPRESSORS
from longboat.strategy import Strategy

Hook = Callable[["HookState", dist.GradBucket], Future]


@dataclass
class HookState:
    """What the hook keeps between buckets: the algorithm with its compressor, the plan, and
    DDP's live buckets by ``bucket.index()`` (weak references: an entry never keeps a bucket
    alive)."""

    plan: CollectivePlan
    group: dist.ProcessGroup
    allreduce: AllreduceFn
    compressor: object
    world_size: int
    _buckets: dict[int, weakref.ref[torch.Tensor]] = field(default_factory=dict)

    def buckets(self) -> list[int]:
        """The indices of the DDP buckets the compressor holds state for, in order."""
        return sorted(i for i, ref in self._buckets.items() if ref() is not None)

    def follow(self, bucket: dist.GradBucket) -> None:
        """Keep the compressor in step with DDP's buckets. DDP rebuilds them after the first
        iteration (in gradient order): the buffers it held before are gone, so the first
        bucket after that drops every entry and the compressor's state, on every rank alike
        (no bucket is in flight then). Each new bucket's layout is given to the compressor
        once: PowerSGD compresses each parameter as its own matrix."""
        buffer = bucket.buffer()
        known = self._buckets.get(bucket.index())
        if known is not None and known() is buffer:
            return
        if any(ref() is None for ref in self._buckets.values()):  # DDP rebuilt its buckets
            self._buckets.clear()
            reset = getattr(self.compressor, "reset", None)
            if reset is not None:
                reset()
        self._buckets[bucket.index()] = weakref.ref(buffer)
        set_layout = getattr(self.compressor, "set_layout", None)
        if set_layout is None:
            return
        offsets, at = [], 0
        for grad in bucket.gradients():
            offsets.append((at, grad.shape))
            at += grad.numel()
        set_layout(buffer, offsets)


def ddp_comm_hook(
    strategy: Strategy | None = None, group: dist.ProcessGroup | None = None
) -> tuple[HookState, Hook]:
    """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook(state, hook)``.

    Collective: every rank of ``group`` (default: the world) calls it, in the same order, as
    building the algorithm may create sub-groups or shared-memory segments. ``strategy``
    defaults to ``lb.Strategy()``.
    """
    strategy = strategy or Strategy()
    strategy.check()
    if strategy.mode != "collective":
        raise ValueError(f"a DDP communication hook reduces gradients: mode={strategy.mode!r}")
    from longboat.collective.live import live_placement

    if not cluster.is_initialized():  # accelerate & co. created the group: adopt it
        cluster.init(strategy)
    group = group if group is not None else dist.group.WORLD
    spans_world = dist.get_world_size(group) == dist.get_world_size()
    placement = live_placement()
    if not spans_world:  # a sub-group: its own ranks' nodes
        ranks = dist.get_process_group_ranks(group)
        placement = Placement.of([placement.node_of[r] for r in ranks], placement.backend, False)
    plan = resolve(strategy, placement)
    if COMPRESSORS.entry(plan.compression.name).momentum:
        raise ValueError(
            f"{plan.compression.name} cannot run as a DDP communication hook: its momentum "
            "correction replaces the optimizer's momentum, which needs lb.distribute's "
            "optimizer; use lb.distribute, or gradient_compression='powersgd' / 'bf16' with DDP"
        )
    inner = algorithms.make(plan.comm.algorithm, group, plan.comm.options)
    compressor = make_compressor(plan.compression.name, inner, group, plan.compression.config)
    allreduce: AllreduceFn = SerialAllreduce(compressor) if plan.comm.serial else compressor
    state = HookState(plan, group, allreduce, compressor, dist.get_world_size(group))
    return state, _hook


def _hook(state: HookState, bucket: dist.GradBucket) -> Future:
    """Average ``bucket`` in place with longboat's algorithm; a future of the averaged tensor."""
    tensor = bucket.buffer()
    tensor.div_(state.world_size)  # DDP's buckets hold sums-to-be: pre-divide, as lb does
    state.follow(bucket)
    handle = state.allreduce(tensor)
    source = future_of(handle)
    if source is None:  # one rank, or an algorithm that only has wait()
        wait_for(handle)  # the current stream now waits for it
        return completed(tensor)
    return source.then(lambda f: _reduced(f, tensor))


# DDP checks the hook's annotations as objects; this module's are strings (postponed)
_hook.__annotations__ = {
    "state": HookState,
    "bucket": dist.GradBucket,
    "return": Future[torch.Tensor],
}


def _reduced(source: Future, tensor: torch.Tensor) -> torch.Tensor:
    source.wait()  # re-raises the collective's error into DDP's future
    return tensor
