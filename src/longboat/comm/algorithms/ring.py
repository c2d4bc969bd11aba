"""ring: the classic ring allreduce, built from point-to-point messages.

The tensor is split into N chunks (N = ranks in the group; chunk c has ``numel // N`` elements,
plus one for the first ``numel % N`` chunks). In 2·(N−1) steps every rank sends one chunk to its
right neighbour and receives one from its left, at the same time:

* step t < N−1 (scatter-reduce): send chunk (r−t) mod N, receive chunk (r−t−1) mod N and add
  it into the local copy. Afterwards rank r holds the full sum of chunk (r+1) mod N.
* step t ≥ N−1 (allgather): the same chunk arithmetic, but the received chunk replaces the
  local one.

Chunk c is summed in one fixed order, ``((x_c + x_{c+1}) + x_{c+2}) + … + x_{c−1}`` (rank
indices mod N, ``x_i`` the input of group rank i), on rank c−1, and the allgather copies those
bits to every rank: all ranks end with bitwise identical results.

Each chunk is cut into pipeline segments of ``segment_bytes``: segment j of step t+1 is sent as
soon as segment j of step t has arrived and been reduced, while the later segments of step t
are still on the wire. Bytes per call, for ``numel`` elements of ``e`` bytes and chunk sizes
``s_c``: rank r sends ``e·(2·numel − s_{r+1} − s_{r+2})`` and receives
``e·(2·numel − s_r − s_{r+1})`` (indices mod N); ``2·K·(N−1)/N`` for K = e·numel when N
divides numel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from longboat.comm.algorithms import Network, Parts, register
from longboat.comm.background import AsyncAllreduce

#: Pipeline segment size. Measured on 2 CPU cores over loopback Gloo (docs/algorithms.md):
#: 4 MB is within noise of unsegmented for a 64 MB allreduce, 256 KB is ~1.5x slower
#: (per-message overhead); on real networks segments let reduction overlap the wire.
DEFAULT_SEGMENT_BYTES = 4 << 20

SUPPORTED_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
)

Bounds = tuple[int, int]


def chunk_bounds(numel: int, parts: int) -> list[Bounds]:
    """``[start, end)`` of each of ``parts`` chunks; the first ``numel % parts`` get one more."""
    base, extra = divmod(numel, parts)
    bounds, start = [], 0
    for c in range(parts):
        end = start + base + (1 if c < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def expected_bytes(numel: int, element_size: int, size: int, rank: int) -> tuple[int, int]:
    """(sent, received) bytes of one ring allreduce on group rank ``rank`` of ``size``."""
    if size == 1 or numel == 0:
        return 0, 0
    s = [end - start for start, end in chunk_bounds(numel, size)]
    sent = 2 * numel - s[(rank + 1) % size] - s[(rank + 2) % size]
    received = 2 * numel - s[rank] - s[(rank + 1) % size]
    return sent * element_size, received * element_size


def check_dtype(tensor: torch.Tensor, algorithm: str) -> None:
    """Reject dtypes the Python algorithms do not reduce, naming the supported ones."""
    if tensor.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise TypeError(
            f"{algorithm} allreduce does not support {tensor.dtype}; use one of {names} "
            "or the 'native' algorithm"
        )


def run_flat(tensor: torch.Tensor, body: Callable[[torch.Tensor], None], to_cpu: bool) -> None:
    """Run ``body`` on a flat contiguous view of ``tensor`` (a copy if needed), in place."""
    if tensor.is_contiguous() and not to_cpu:
        body(tensor.view(-1))
        return
    work = tensor.detach().to("cpu" if to_cpu else tensor.device).contiguous().view(-1)
    body(work)
    tensor.copy_(work.view(tensor.shape))


class Ring:
    """Blocking in-place SUM ring allreduce over ``group``, with byte counters.

    Counters (bytes, this rank): ``bytes_sent``/``bytes_received`` since creation,
    ``last_bytes_sent``/``last_bytes_received`` of the latest call, ``calls``.
    """

    def __init__(self, group: dist.ProcessGroup, segment_bytes: int = DEFAULT_SEGMENT_BYTES):
        if segment_bytes < 1:
            raise ValueError(f"segment_bytes must be positive, got {segment_bytes}")
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.segment_bytes = segment_bytes
        self.right = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.left = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self.gloo = dist.get_backend(group) == "gloo"
        self.bytes_sent = self.bytes_received = 0
        self.last_bytes_sent = self.last_bytes_received = 0
        self.calls = 0

    def __call__(self, tensor: torch.Tensor) -> None:
        check_dtype(tensor, "ring")
        self.last_bytes_sent = self.last_bytes_received = 0
        self.calls += 1
        if self.size > 1 and tensor.numel() > 0:
            run_flat(tensor, self._allreduce, to_cpu=self.gloo and tensor.device.type != "cpu")
        self.bytes_sent += self.last_bytes_sent
        self.bytes_received += self.last_bytes_received

    def _allreduce(self, flat: torch.Tensor) -> None:
        _RingCall(self, flat).run()


class _RingCall:
    """One allreduce: the chunk arithmetic and the segment pipeline."""

    def __init__(self, ring: Ring, flat: torch.Tensor):
        self.ring, self.flat = ring, flat
        n = ring.size
        self.chunks = chunk_bounds(flat.numel(), n)
        self.seg = max(1, ring.segment_bytes // flat.element_size())
        self.steps = 2 * (n - 1)
        longest = max(end - start for start, end in self.chunks)
        self.scratch = torch.empty(longest, dtype=flat.dtype, device=flat.device)
        self.sends: list[dict[int, dist.Work]] = [{} for _ in range(self.steps)]
        self.recvs: list[dict[int, dist.Work]] = [{} for _ in range(self.steps)]

    def chunk(self, t: int, received: bool) -> Bounds:
        """Chunk sent (or received) at step t: (r − t) mod N (or (r − t − 1) mod N)."""
        return self.chunks[(self.ring.rank - t - (1 if received else 0)) % self.ring.size]

    def segment(self, t: int, j: int, received: bool) -> Bounds | None:
        start, end = self.chunk(t, received)
        lo = start + j * self.seg
        return (lo, min(lo + self.seg, end)) if lo < end else None

    def segment_count(self, t: int, received: bool) -> int:
        start, end = self.chunk(t, received)
        return -(-(end - start) // self.seg)

    def run(self) -> None:
        for j in range(max(self.segment_count(0, False), self.segment_count(0, True))):
            self.post(0, j)
        for t in range(self.steps):
            self.finish_step(t)

    def post(self, t: int, j: int) -> None:
        """Start segment j of step t: its send and its receive, as one batch."""
        ring, ops = self.ring, []
        send = self.segment(t, j, received=False)
        recv = self.segment(t, j, received=True)
        if send is not None:
            ops.append(dist.P2POp(dist.isend, self.flat[send[0] : send[1]], ring.right, ring.group))
        if recv is not None:
            ops.append(dist.P2POp(dist.irecv, self.landing(t, recv), ring.left, ring.group))
        works = dist.batch_isend_irecv(ops)
        if send is not None:
            self.sends[t][j] = works[0]
            ring.last_bytes_sent += (send[1] - send[0]) * self.flat.element_size()
        if recv is not None:
            self.recvs[t][j] = works[-1]
            ring.last_bytes_received += (recv[1] - recv[0]) * self.flat.element_size()

    def landing(self, t: int, bounds: Bounds) -> torch.Tensor:
        """Where a received segment goes: scratch to be added (scatter), else in place."""
        lo, hi = bounds
        if t >= self.ring.size - 1:
            return self.flat[lo:hi]
        start = self.chunk(t, received=True)[0]
        return self.scratch[lo - start : hi - start]

    def finish_step(self, t: int) -> None:
        """Reduce step t's segments as they arrive, starting step t+1's right behind them."""
        reduce = t < self.ring.size - 1
        last = t + 1 == self.steps
        count = self.segment_count(t, True)
        for j in range(count):
            self.wait(self.recvs[t].pop(j), t, "receive from", self.ring.left)
            if reduce:
                bounds = self.segment(t, j, received=True)
                assert bounds is not None  # j < segment_count: segment j exists
                lo, hi = bounds
                self.flat[lo:hi].add_(self.landing(t, (lo, hi)))
            if not last:
                self.post_next(t, j)
        if not last:
            more = max(self.segment_count(t + 1, False), self.segment_count(t + 1, True))
            for j in range(count, more):
                self.post_next(t, j)
        for j in list(self.sends[t]):
            self.wait(self.sends[t].pop(j), t, "send to", self.ring.right)

    def post_next(self, t: int, j: int) -> None:
        # with two ranks, step t+1 receives into the chunk step t sends: finish that send first
        # (a Gloo work must be waited exactly once, hence pop)
        if self.chunk(t + 1, received=True) == self.chunk(t, received=False) and j in self.sends[t]:
            self.wait(self.sends[t].pop(j), t, "send to", self.ring.right)
        self.post(t + 1, j)

    def wait(self, work: dist.Work, t: int, what: str, peer: int) -> None:
        try:
            work.wait()
        except Exception as exc:
            phase = "scatter-reduce" if t < self.ring.size - 1 else "allgather"
            raise RuntimeError(
                f"ring allreduce on rank {dist.get_rank()}: step {t} ({phase}) could not "
                f"{what} rank {peer}: {exc}"
            ) from exc


def cost(nbytes: float, net: Network) -> Parts:
    """A ring over every rank (NCCL's ring on GPUs)."""
    return net.nccl(nbytes, "ring") if net.on_device else net.flat(nbytes, "ring")


@register("ring", topologies=("many_ranks",), tune=False, cost=cost)
def make_ring(
    group: dist.ProcessGroup, segment_bytes: int = DEFAULT_SEGMENT_BYTES
) -> AsyncAllreduce[Ring]:
    """Asynchronous ring allreduce over ``group``; counters at ``fn.state``."""
    return AsyncAllreduce(Ring(group, segment_bytes), "ring", check=_check_ring)


def _check_ring(tensor: torch.Tensor) -> None:
    check_dtype(tensor, "ring")
