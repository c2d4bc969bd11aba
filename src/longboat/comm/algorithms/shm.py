"""shm: allreduce, reduce-scatter and all-gather among the ranks of one node through shared
memory (/dev/shm).

The CPU counterpart of GPU peer-to-peer inside a node: no loopback TCP, just copies and
additions on memory every rank maps, synchronised by sequence numbers in each rank's segment
(`longboat.comm.shm_group`; layout in `longboat.comm.shm_segment`). Each op ``k`` on rank
``r`` of ``n`` is built from two halves:

- scatter: copy every rank's chunk but r's own into input area ``k % 2`` of r's segment (double
  buffer), ``written = k``; wait until every rank's ``written >= k``; sum chunk ``r`` of every
  input in rank order (r's own straight from its tensor);
- collect: copy every peer's chunk from the start of one of its data areas.

A reduce-scatter is a scatter into the output (one barrier); an all-gather writes r's chunk to
its input area, ``written = k``, waits, and collects from the input areas (one barrier). Its
slices may live in pieces (`ShmComm.all_gather_placed`, `longboat.comm.placed`): each piece is
copied straight to or from the segments, with no contiguous buffer on either side. An
allreduce of a small tensor sums every input whole (one barrier); a large one, per piece of at
most ``piece_bytes``, scatters into r's result area, ``reduced = k``, waits until every
``reduced >= k``, and collects from the result areas (two barriers). A reduce-scatter or
all-gather goes in pieces too: each takes the same columns of every rank's slice.

No "done" barrier is needed: input area ``k % 2`` is rewritten at op ``k + 2``, after the
``written >= k + 1`` barrier, which no peer passes before finishing op ``k``; the result area is
rewritten only after the next ``written`` barrier, likewise. Every chunk is summed once, in
rank order, so results are deterministic and bitwise identical on every rank.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from functools import lru_cache

import torch
import torch.distributed as dist

from longboat.comm.algorithms import AllreduceFn, Done, Network, Parts, register
from longboat.comm.background import BackgroundAllreduce
from longboat.comm.handles import FutureHandle
from longboat.comm.placed import PlacedSlices
from longboat.comm.shm_group import (
    PIECE_BYTES,
    SMALL_BYTES,
    SUPPORTED,
    PeerDiedError,
    PeerFailedError,
    ShmGroup,
    capacity_for,
    check_one_node,
    cleanup_stale_segments,
)
from longboat.comm.shm_segment import SLOT_REDUCED, SLOT_WRITTEN

__all__ = [
    "PIECE_BYTES",
    "SMALL_BYTES",
    "SUPPORTED",
    "PeerDiedError",
    "PeerFailedError",
    "ShmAllreduce",
    "ShmComm",
    "capacity_for",
    "check_one_node",
    "chunk_bounds",
    "cleanup_stale_segments",
    "make_shm",
]

Op = Callable[[torch.Tensor, torch.Tensor], None]
"""One piece of a reduce-scatter: ``(rows, part)``."""


@lru_cache(maxsize=256)
def chunk_bounds(numel: int, parts: int, align: int) -> tuple[tuple[int, int], ...]:
    """Split ``range(numel)`` into ``parts`` contiguous chunks starting at multiples of ``align``."""
    units = -(-numel // align)
    base, extra = divmod(units, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = min(numel, start + (base + (i < extra)) * align)
        bounds.append((start, stop))
        start = stop
    return tuple(bounds)


class ShmComm(ShmGroup):
    """Blocking SUM allreduce, reduce-scatter and all-gather over ``group``, whose ranks must
    share this node (collective constructor: `ShmGroup`)."""

    # ---- the collectives -------------------------------------------------------------------
    def allreduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the group, in place; blocks until done."""
        self._checked(tensor.dtype)
        if self.size == 1 or tensor.numel() == 0:
            return
        staged = tensor.device.type != "cpu" or not tensor.is_contiguous()
        work = tensor.detach().to("cpu").contiguous() if staged else tensor.detach()
        self._guarded(self._allreduce_flat, work.view(-1))
        if staged:
            tensor.copy_(work)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> None:
        """Sum ``full`` over the group and keep this rank's slice in ``out``: ``full`` holds
        ``size`` equal slices of ``out.numel()`` elements, slice ``rank`` is this rank's (as
        torch's ``reduce_scatter_tensor``); ``out`` must not overlap another rank's slice."""
        rows = self._rows(full, out)
        if self.size == 1:
            out.view(-1).copy_(rows[0])
            return
        self._guarded(self._pieces, self._op_reduce_scatter, rows, out.detach().view(-1))

    def all_gather(self, full: torch.Tensor, mine: torch.Tensor) -> None:
        """Every rank's ``mine`` into its slice of ``full`` (slices in rank order, as torch's
        ``all_gather_into_tensor``); ``mine`` may be this rank's slice of ``full``."""
        rows = self._rows(full, mine)
        self.all_gather_placed(PlacedSlices.whole(rows, mine.detach().view(-1)))

    def all_gather_placed(self, slices: PlacedSlices) -> None:
        """Every rank's elements into their places, as ``slices`` lays them out."""
        dtype = self.check_placed(slices)
        if slices.numel == 0:
            return
        if self.size == 1:
            slices.place_own(0, 0, slices.numel)
            return
        self._guarded(self._op_all_gather, slices, dtype)

    def check_placed(self, slices: PlacedSlices) -> torch.dtype:
        """``slices.check`` for this group, and a dtype it takes; their dtype."""
        dtype = slices.check(self.size)
        self._checked(dtype)
        return dtype

    def _rows(self, full: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        """``full`` as ``(size, part.numel())``: one row per rank's slice."""
        self._checked(full.dtype)
        tensors = (full, part)
        if part.dtype != full.dtype or full.numel() != self.size * part.numel():
            raise ValueError(
                f"shm: {full.numel()} {full.dtype} elements are not {self.size} slices of "
                f"{part.numel()} {part.dtype} ones"
            )
        if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
            raise ValueError("shm reduce-scatter and all-gather take contiguous CPU tensors")
        return full.detach().view(self.size, -1)

    def _pieces(self, op: Op, rows: torch.Tensor, part: torch.Tensor) -> None:
        """``op(rows[:, cols], part[cols])`` for the columns of each piece, in order."""
        for cols in self._columns(part.numel(), part.element_size()):
            op(rows[:, cols], part[cols])

    def _columns(self, numel: int, itemsize: int) -> Iterator[slice]:
        """The columns of each piece: every rank's slice of at most ``piece_bytes`` together."""
        step = max(1, self.piece_bytes // (itemsize * self.size))
        return (slice(c, min(c + step, numel)) for c in range(0, numel, step))

    # ---- the ops -----------------------------------------------------------------------------
    def _allreduce_flat(self, flat: torch.Tensor) -> None:
        nbytes = flat.numel() * flat.element_size()
        if nbytes <= self.small_bytes:
            self._op_direct(flat)
            return
        step = max(1, self.piece_bytes // flat.element_size())
        for start in range(0, flat.numel(), step):
            self._op_scatter_gather(flat[start : start + step])

    def _op_direct(self, x: torch.Tensor) -> None:
        """Every rank sums every input: one barrier."""
        k, area = self._begin(x.numel() * x.element_size())
        self._segs[self.rank].area(area, x.dtype, x.numel()).copy_(x)
        self._publish(SLOT_WRITTEN, k)
        self._wait_all(SLOT_WRITTEN, k, "written")
        # my own input from my segment too: ``x`` is the output and must not alias an operand
        _sum_into(x, [self._segs[r].area(area, x.dtype, x.numel()) for r in range(self.size)])

    def _op_scatter_gather(self, x: torch.Tensor) -> None:
        """Allreduce: scatter into my result area, then collect: two barriers."""
        parts = [
            x[a:b] for a, b in chunk_bounds(x.numel(), self.size, max(1, 64 // x.element_size()))
        ]
        k, result = self._scatter(parts, None)
        parts[self.rank].copy_(result)
        self._publish(SLOT_REDUCED, k)
        self._wait_all(SLOT_REDUCED, k, "reduced")
        self._collect(parts, 2)

    def _op_reduce_scatter(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """My row of every rank's ``rows`` summed into ``out``: one barrier."""
        self._scatter(list(rows.unbind(0)), out)

    def _op_all_gather(self, slices: PlacedSlices, dtype: torch.dtype) -> None:
        """Per piece of columns: this rank's elements into its input area, then every rank's
        into their places: one barrier each."""
        for cols in self._columns(slices.numel, dtype.itemsize):
            width = cols.stop - cols.start
            k, area = self._begin(width * dtype.itemsize)
            slices.send(cols, self._segs[self.rank].area(area, dtype, width))
            self._publish(SLOT_WRITTEN, k)
            slices.place_own(self.rank, cols.start, cols.stop)  # while the peers catch up
            self._wait_all(SLOT_WRITTEN, k, "written")
            for r in self._peers():
                slices.receive(r, cols, self._segs[r].area(area, dtype, width))

    # ---- the halves --------------------------------------------------------------------------
    def _scatter(
        self, parts: list[torch.Tensor], out: torch.Tensor | None
    ) -> tuple[int, torch.Tensor]:
        """Op ``k``'s first half: ``parts[r]`` is the chunk rank ``r`` sums; every rank's chunk
        ``rank`` summed into ``out`` (None: my result area). Returns ``(k, out)``."""
        me, dtype = self.rank, parts[0].dtype
        offsets = list(itertools.accumulate((p.numel() for p in parts), initial=0))
        k, area = self._begin(offsets[-1] * dtype.itemsize)
        staged = self._segs[me].area(area, dtype, offsets[-1])
        for r in self._peers():  # my own chunk is read only by me: no copy
            staged[offsets[r] : offsets[r + 1]].copy_(parts[r])
        self._publish(SLOT_WRITTEN, k)
        self._wait_all(SLOT_WRITTEN, k, "written")
        lo, hi = offsets[me], offsets[me + 1]
        if out is None:
            out = self._segs[me].area(2, dtype, hi - lo)
        self._reduce_chunk(parts, area, lo, hi, out)
        return k, out

    def _reduce_chunk(
        self, parts: list[torch.Tensor], area: int, lo: int, hi: int, out: torch.Tensor
    ) -> None:
        """Sum elements ``[lo, hi)`` of every rank's input area into ``out``; mine from
        ``parts``."""
        if hi == lo:
            return
        inputs = [
            parts[r] if r == self.rank else self._segs[r].area(area, out.dtype, hi)[lo:hi]
            for r in range(self.size)
        ]
        _sum_into(out, inputs)

    def _collect(self, parts: list[torch.Tensor], area: int) -> None:
        """Every peer's chunk, from the start of its data area ``area``, into ``parts``."""
        for r in self._peers():
            parts[r].copy_(self._segs[r].area(area, parts[r].dtype, parts[r].numel()))


def _sum_into(out: torch.Tensor, inputs: list[torch.Tensor]) -> None:
    """``out = inputs[0] + inputs[1] + ...`` in that order (``out`` aliases none of them)."""
    torch.add(inputs[0], inputs[1], out=out)
    for more in inputs[2:]:
        out.add_(more)


class ShmAllreduce(BackgroundAllreduce):
    """The AllreduceFn: ``ShmComm.allreduce`` on a worker thread; its reduce-scatter and
    all-gather queue behind it in the same order; ``close()`` also unlinks."""

    def __init__(self, comm: ShmComm):
        self.comm = comm
        super().__init__(comm.allreduce, "shm")

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> FutureHandle:
        """Start `ShmComm.reduce_scatter`; the handle's future holds ``out``."""
        self.comm._rows(full, out)  # a bad argument raises here, in the caller's thread
        return FutureHandle(self(out, lambda o: self.comm.reduce_scatter(o, full)))

    def all_gather(self, full: torch.Tensor, mine: torch.Tensor) -> FutureHandle:
        """Start `ShmComm.all_gather`; the handle's future holds ``full``."""
        self.comm._rows(full, mine)
        return FutureHandle(self(full, lambda f: self.comm.all_gather(f, mine)))

    def all_gather_placed(self, slices: PlacedSlices) -> FutureHandle:
        """Start `ShmComm.all_gather_placed`; the handle's future holds an empty tensor."""
        self.comm.check_placed(slices)  # a bad argument raises here, in the caller's thread
        done = torch.empty(0)
        return FutureHandle(self(done, lambda _: self.comm.all_gather_placed(slices)))

    def close(self, timeout: float | None = None) -> None:
        """Finish queued work, stop the worker, remove this rank's segment."""
        super().close(timeout)
        self.comm.close()


def cost(nbytes: float, net: Network) -> Parts | None:
    """Host shared memory: one node of CPU ranks only."""
    if net.nodes == 1 and net.host_shared_memory and not net.on_device:
        return net.shm(nbytes)
    return None


@register("shm", topologies=("one_node",), broadcast=True, cost=cost)
def make_shm(group: dist.ProcessGroup) -> AllreduceFn:
    """Asynchronous in-place SUM allreduce through /dev/shm; every rank must be on this node."""
    if dist.get_world_size(group) == 1:
        return lambda tensor: Done()
    return ShmAllreduce(ShmComm(group))
