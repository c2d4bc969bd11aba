"""Reducer: gradient hooks -> fused buckets -> asynchronous allreduce -> averaged grads.

Each parameter's post-accumulate-grad hook copies its gradient into its bucket's flat buffer;
when a bucket is full it is launched asynchronously on its communicator, while backward goes
on computing earlier layers (overlap). Buckets are launched strictly in plan order, so every
rank issues the same collectives in the same order even when ranks differ in which
parameters got gradients. A callback queued on the autograd engine runs when backward ends:
it launches whatever is left (filling missing gradients with zeros), waits for every bucket
and points each ``param.grad`` at its averaged slot of the bucket buffer. Gradients are divided
by the world size as they are copied into the bucket (during backward), so nothing but the
allreduce remains on the critical path once backward ends.

What reducing a bucket is, is handed in (`BucketCollective`): the allreduce (`Allreduce`, the
default), or sharding stage 2's reduce-scatter into this rank's slice, whose full buffers live
only from packing to the end of backward.

The final bucket carries one extra slot per parameter: 1 if this rank produced a gradient for
it. After the allreduce every rank knows how many ranks used each parameter, at no extra
communication: that is how unused parameters are detected (and named) on every rank.

Nothing here blocks the host on a GPU: the hooks only launch kernels, the allreduces run on
the communicators' streams and ``wait()`` makes the compute stream wait for them, the
used-parameter marks are kept on the host and written to the device once per backward
(`longboat.collective.usage`), and the AMP overflow check stays on the device until the
optimizer step asks for it (one read per step). docs/collective.md draws the streams.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from longboat.collective.buckets import (
    Allreduce,
    BucketCollective,
    BucketPlan,
    assign_communicators,
)
from longboat.collective.compile_guard import refuse_compiled_autograd
from longboat.collective.usage import PendingCounts, UsageMarks, read_counts, reads_block
from longboat.comm.algorithms import AllreduceFn, Handle
from longboat.comm.handles import wait_for

if TYPE_CHECKING:
    from longboat.trace.observer import Observer

_FLAG_DTYPES = (torch.float32, torch.float64)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``numel`` consecutive places in some order (no gaps)."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda p: p[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


UNUSED_FIX = (  # the fix for lb.distribute's caller; other doors (Lightning) reword it
    "Make every parameter that requires grad take part in the loss on every rank, freeze it "
    "(requires_grad_(False)) before lb.distribute, or pass "
    "Strategy(find_unused_parameters=True) to reduce missing gradients as zeros."
)


class UnusedParametersError(RuntimeError):
    """Some parameters received no gradient on some ranks and find_unused_parameters is off."""


class _Bucket:
    """One fused reduction: a flat buffer and the parameters it holds."""

    def __init__(
        self,
        index: int,
        members: Sequence[int],
        params: Sequence[nn.Parameter],
        comm: int,
        kept: bool = True,
    ):
        self.index = index
        self.members = tuple(members)
        self.comm = comm
        first = params[members[0]]
        self.offsets: list[int] = []
        total = 0
        for i in members:
            self.offsets.append(total)
            total += params[i].numel()
        self.numel = total
        # kept: zeros between backwards; else empty until packed
        self.buffer = torch.zeros(total if kept else 0, dtype=first.dtype, device=first.device)
        self.pending = len(self.members)
        self.handle: Handle | None = None

    def grow(self, extra: int) -> None:
        """Append ``extra`` trailing slots (the used-parameter flags)."""
        self.buffer = torch.zeros(
            self.numel + extra, dtype=self.buffer.dtype, device=self.buffer.device
        )


class Reducer:
    """Averages gradients across ranks during backward; see the module docstring.

    ``observer`` (`longboat.trace.Observer`, or None) hears of each bucket and backward: set by
    ``lb.trace.attach`` after construction, not passed to it, because the observer's stall watch
    is built from this reducer's `bucket_members`, and ``Strategy(auto=True)`` hands it on to
    each candidate reducer it installs. A plain attribute, read on the hot path.

    ``collective`` (default: `Allreduce` of ``allreduce_fns``) is what each bucket's reduction
    is; the used-parameter flags always go through ``flag_fns`` (default ``allreduce_fns``).
    """

    observer: Observer | None

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        plan: BucketPlan,
        allreduce_fns: Sequence[AllreduceFn],
        *,
        world_size: int,
        find_unused_parameters: bool = False,
        check_finite: bool = False,
        flag_fns: Sequence[AllreduceFn] | None = None,
        collective: BucketCollective | None = None,
    ):
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.world_size = world_size
        self.find_unused = find_unused_parameters
        self.check_finite = check_finite
        self._finite: torch.Tensor | None = None  # AMP: device flag, read by last_finite
        self._finite_read: bool | None = None
        self._fns = list(allreduce_fns)
        self.collective = collective if collective is not None else Allreduce(self._fns)
        kept = self.collective.keeps_buffers
        # lossy compressors get the used-parameter flags sent apart, exactly, through these
        self._flag_fns = list(flag_fns) if flag_fns is not None else self._fns
        sizes = [sum(self.params[i].nbytes for i in members) for members in plan.buckets]
        comms = assign_communicators(sizes, len(self._fns))
        self._buckets = [
            _Bucket(b, members, self.params, comm=comms[b], kept=kept)
            for b, members in enumerate(plan.buckets)
        ]
        self._where = [(0, 0)] * len(self.params)  # param index -> (bucket, offset)
        for bucket in self._buckets:
            for i, off in zip(bucket.members, bucket.offsets, strict=True):
                self._where[i] = (bucket.index, off)
        apart = flag_fns is not None or not kept
        self._flags, self._flags_handle_separate = self._make_flags(apart=apart)
        self._slots = [  # not kept: the (empty) bucket buffer, until a pack makes the views
            self._slot_view(i) if kept else self._buckets[self._where[i][0]].buffer
            for i in range(len(self.params))
        ]
        self._ready = [False] * len(self.params)
        self._marks = UsageMarks(len(self.params))
        self._reads_block = reads_block(self._flags.device)
        # counts on their way to the host, oldest first, each checked once it has landed
        self._pending_counts: collections.deque[PendingCounts] = collections.deque()
        self._sync = True
        self._scale = 1.0 / world_size
        self._prepared = False
        self._callback_queued = False
        self._next = 0
        self._flags_handle: Handle | None = None
        self.observer = None  # longboat.trace: timeline and stall inspector
        self._hooks = [
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))
            for i, p in enumerate(self.params)
        ]

    # -- set-up -------------------------------------------------------------------------------

    def _make_flags(self, apart: bool) -> tuple[torch.Tensor, bool]:
        last = self._buckets[-1]
        n = len(self.params)
        if last.buffer.dtype in _FLAG_DTYPES and not apart:
            last.grow(n)
            return last.buffer[last.numel :], False
        return torch.zeros(n, dtype=torch.float32, device=last.buffer.device), True

    def _slot_view(self, i: int) -> torch.Tensor:
        """Parameter i's place in its bucket buffer, with the parameter's shape and strides.

        A channels_last (or otherwise permuted but dense) parameter gets a slot in its own
        layout: copying its gradient in is a straight copy, and the optimizer later reads
        ``.grad`` in the layout of the parameter it updates.
        """
        b, off = self._where[i]
        param = self.params[i]
        buffer = self._buckets[b].buffer
        if param.is_contiguous() or not _dense(param):
            return buffer[off : off + param.numel()].view_as(param)
        return buffer.as_strided(param.shape, param.stride(), buffer.storage_offset() + off)

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def bucket_members(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        return [[self.names[i] for i in b.members] for b in self._buckets]

    def bucket_layouts(self) -> list[tuple[torch.Tensor, list[tuple[int, torch.Size]]]]:
        """Each bucket's buffer with its parameters' ``(offset, shape)``, in launch order.

        Compressors that treat each gradient as a matrix (PowerSGD, DGC) read this once.
        """
        layouts = []
        for b in self._buckets:
            shapes = [self.params[i].shape for i in b.members]
            layouts.append((b.buffer, list(zip(b.offsets, shapes, strict=True))))
        return layouts

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # -- per backward -------------------------------------------------------------------------

    def prepare(self, sync: bool, divisor: float) -> None:
        """Called at forward: whether the coming backward communicates, and the divisor."""
        self._check_pending_counts()
        self._sync = sync
        self._scale = 1.0 / divisor
        self._reset()
        self._prepared = True

    def mark_unused(self, params: Iterable[int]) -> None:
        """Mark parameters (indices) that the coming backward cannot reach as ready now."""
        if not self._sync:
            return
        for i in params:
            if not self._ready[i]:
                self._fill(i)

    def _reset(self) -> None:
        self._ready = [False] * len(self.params)
        self._marks.reset()
        for b in self._buckets:
            b.pending = len(b.members)
            b.handle = None
        self._next = 0
        self._callback_queued = False
        self._flags_handle = None

    def _on_grad(self, i: int, param: torch.Tensor) -> None:
        if not self._prepared:
            self.prepare(sync=True, divisor=float(self.world_size))
        if not self._sync:
            return
        if self._ready[i]:
            raise RuntimeError(
                f"parameter {self.names[i]!r} received a gradient twice in one backward pass "
                "(reentrant checkpointing or a module reused across backward calls?). "
                "longboat reduces each gradient once per backward; use non-reentrant "
                "checkpointing (use_reentrant=False)."
            )
        if not self._callback_queued:
            refuse_compiled_autograd()  # once per backward
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
        self._fill(i)

    def _fill(self, i: int) -> None:
        """Parameter i's gradient is final: count it, and pack its bucket once all are in."""
        grad = self.params[i].grad
        if grad is not None:
            if grad.is_sparse:
                raise RuntimeError(
                    f"parameter {self.names[i]!r} has a sparse gradient; collective mode "
                    "reduces dense gradients only (use sparse=False, or the PS mode)."
                )
            self._marks.mark(i)  # host bookkeeping: written to the device once, at launch
        self._ready[i] = True
        bucket = self._buckets[self._where[i][0]]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._pack(bucket)
            if self.observer is not None:
                self.observer.bucket_ready(bucket.index)
            self._launch_in_order()

    def _pack(self, bucket: _Bucket) -> None:
        """Copy the bucket's gradients into its buffer, pre-divided (zeros where none).

        One multi-tensor copy and one scale per bucket: per-gradient kernels launched from
        Python would make the host, not the GPU, set the pace of backward. A collective that
        does not keep the buffers gives a fresh one here, and the ``.grad`` copied in go.
        """
        kept = self.collective.keeps_buffers
        if not kept:
            bucket.buffer = self.collective.buffer(bucket.index)
            for i in bucket.members:
                self._slots[i] = self._slot_view(i)
        targets, sources = [], []
        for i in bucket.members:
            grad, slot = self.params[i].grad, self._slots[i]
            if grad is None:
                slot.zero_()
            elif grad.data_ptr() != slot.data_ptr():  # else accumulated in place already
                targets.append(slot)
                sources.append(grad)
        if targets:
            torch._foreach_copy_(targets, sources)
        if self._scale != 1.0:
            bucket.buffer[: bucket.numel].mul_(self._scale)
        if not kept:
            for i in bucket.members:
                self.params[i].grad = None

    def _launch_in_order(self) -> None:
        while self._next < len(self._buckets) and self._buckets[self._next].pending == 0:
            self._launch(self._buckets[self._next])
            self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        last = bucket.index == len(self._buckets) - 1
        if last:  # buckets launch in order: every gradient of this backward is in by now
            self._marks.write(self._flags)
        bucket.handle = self.collective.launch(bucket.index, bucket.comm, bucket.buffer)
        if self.observer is not None:
            self.observer.launched(bucket.index, bucket.comm, bucket.buffer, bucket.handle)
        if self._flags_handle_separate and last:
            self._flags_handle = self._flag_fns[bucket.comm](self._flags)

    def flush(self) -> None:
        """Reduce now, outside backward, and write the averaged gradients to ``.grad``.

        Every gradient not yet in its bucket is taken from its parameter's current ``.grad``
        (zeros where that is None), every bucket is launched and waited for, and each
        ``.grad`` then points at its averaged slot, exactly as at the end of a communicating
        backward pass.

        A communicating backward flushes by itself when it ends: call this only to reduce
        gradients that no communicating backward will, e.g. ones accumulated locally over
        passes prepared with ``sync=False``. Call :meth:`prepare` with ``sync=True`` first,
        not while a backward pass is running, and on every rank at the same point (it runs
        the collectives). ``hvd.DistributedOptimizer.synchronize()`` does this after fewer
        than ``backward_passes_per_step`` passes.
        """
        if not (self._prepared and self._sync):
            raise RuntimeError("Reducer.flush() needs prepare(sync=True, divisor=...) first")
        self.mark_unused(range(len(self.params)))  # launches every bucket, in plan order
        self._finalize()

    def _finalize(self) -> None:
        """End of backward: launch the rest, wait, check usage, write averaged gradients."""
        if self.observer is not None:
            self.observer.backward_end()
        try:
            for i in range(len(self.params)):
                if not self._ready[i]:
                    self._fill(i)
            for bucket in self._buckets:  # every read below is ordered after the reductions
                assert bucket.handle is not None
                wait_for(bucket.handle)
            if self._flags_handle is not None:
                wait_for(self._flags_handle)
            if self.check_finite:  # a rank's inf/NaN is in every rank's sum: same answer everywhere
                self._finite = self.collective.all_finite(
                    [b.buffer[: b.numel] for b in self._buckets]
                )
                self._finite_read = None
            used_on = self._usage()
            self._write_back(used_on)
        finally:
            self._prepared = False
            if self.observer is not None:
                self.observer.synced()

    @property
    def last_finite(self) -> bool:
        """AMP: were the last reduced gradients free of inf/NaN on every rank?

        The check runs on the device at the end of backward; this read is the one host
        synchronisation per step that float16 loss scaling needs (the skip decision).
        """
        if self._finite is None:
            return True
        if self._finite_read is None:
            self._finite_read = bool(self._finite)
        return self._finite_read

    def _usage(self) -> list[int] | None:
        """Ranks that used each parameter, or None when every rank used every parameter.

        Read back (blocking) only where the answer changes what happens now: with
        find_unused_parameters, on the CPU, or when this rank itself missed a gradient
        (about to raise). Otherwise the counts are checked at the next step, unblocking.
        """
        if self.find_unused or not self._reads_block or not self._marks.all_used:
            used_on = read_counts(self._flags)
            if all(n == self.world_size for n in used_on):
                return None
            if not self.find_unused:
                self._raise_if_unused(used_on)
            return used_on
        self._pending_counts.append(PendingCounts(self._flags))
        return None

    def _check_pending_counts(self) -> None:
        """Raise if earlier backwards' counts that have landed show a rank missed a gradient.

        Never blocks: counts still on their way stay queued for a later step, in order, so a
        host running several steps ahead of its GPU still checks every one.
        """
        queue = self._pending_counts
        while queue and queue[0].ready():
            self._raise_if_unused(queue.popleft().counts())

    def _raise_if_unused(self, used_on: list[int]) -> None:
        missing = [i for i, n in enumerate(used_on) if n < self.world_size]
        if not missing:
            return
        shown = ", ".join(
            f"{self.names[i]!r} (no gradient on {self.world_size - used_on[i]} of "
            f"{self.world_size} ranks)"
            for i in missing[:10]
        )
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        local = [self.names[i] for i in missing if self.params[i].grad is None]
        here = f" On this rank: {', '.join(local[:10])}." if local else ""
        raise UnusedParametersError(
            f"{len(missing)} parameter(s) received no gradient in this backward pass on some "
            f"ranks: {shown}{more}.{here} {UNUSED_FIX}"
        )

    def _write_back(self, used_on: list[int] | None) -> None:
        """Point each ``.grad`` at its averaged slot; ``used_on`` None: used everywhere.

        Gradients are views into the bucket buffers (DDP's ``gradient_as_bucket_view``): no
        copy after the allreduce. The next backward overwrites them in place. A collective that
        keeps no buffers left its result elsewhere: the full buffers are released instead.
        """
        if not self.collective.keeps_buffers:
            self._release_buffers()
            return
        for i, (param, reduced) in enumerate(zip(self.params, self._slots, strict=True)):
            if used_on is not None and used_on[i] == 0:
                continue  # unused on every rank: leave .grad as single-process would
            if param.grad is None or param.grad.data_ptr() != reduced.data_ptr():
                param.grad = reduced

    def _release_buffers(self) -> None:
        """Drop every full bucket buffer: its handle (which holds it) and every view of it."""
        for bucket in self._buckets:
            bucket.handle = None
            bucket.buffer = bucket.buffer.new_empty(0)
            for i in bucket.members:
                self._slots[i] = bucket.buffer  # replaced at the next pack
