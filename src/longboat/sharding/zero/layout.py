"""Which elements of each gradient bucket a rank owns under sharding, and what they are.

Every reducer bucket (a flat buffer of its parameters' elements, `longboat.collective.buckets`)
is cut into ``degree`` equal slices of ``ceil(numel / degree)`` elements, the last one padded:
rank ``i`` of a shard group owns slice ``i``. Shards are balanced to the element, and a
parameter may be split across ranks. A slice is cut at parameter boundaries into pieces; each
piece of a parameter the user's optimizer holds becomes one flat shard parameter (a view of
the parameter's own elements) of the optimizer that steps this rank's slices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Piece:
    """Elements ``[start, stop)`` of parameter ``param`` (in memory order), at ``at`` in the
    owned slice."""

    param: int
    start: int
    stop: int
    at: int
    group: int | None
    """The param group of the user's optimizer that holds the parameter (None: none)."""

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class BucketShard:
    """One bucket as the shard group splits it."""

    index: int
    numel: int
    shard_numel: int
    """Elements per slice (the padded bucket holds ``shard_numel * degree``)."""
    lo: int
    hi: int
    """This rank owns bucket elements ``[lo, hi)``."""
    members: tuple[tuple[int, int], ...]
    """``(param, offset in the bucket)`` of every parameter of the bucket."""
    pieces: tuple[Piece, ...]
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """Every bucket's shard of this rank (``index`` in a group of ``degree`` ranks)."""

    degree: int
    index: int
    buckets: tuple[BucketShard, ...]

    @classmethod
    def build(
        cls,
        params: Sequence[torch.Tensor],
        buckets: Sequence[Sequence[int]],
        group_of: Sequence[int | None],
        degree: int,
        index: int,
    ) -> ShardLayout:
        """The layout of ``buckets`` (parameter indices per bucket, in bucket order) for rank
        ``index`` of ``degree``; ``group_of[i]``: the optimizer param group of parameter i."""
        shards = []
        for b, members in enumerate(buckets):
            offsets, total = [], 0
            for i in members:
                offsets.append(total)
                total += params[i].numel()
            size = math.ceil(total / degree)
            lo, hi = min(index * size, total), min((index + 1) * size, total)
            pieces = []
            for i, off in zip(members, offsets, strict=True):
                start, stop = max(lo, off), min(hi, off + params[i].numel())
                if start < stop:
                    pieces.append(Piece(i, start - off, stop - off, start - lo, group_of[i]))
            first = params[members[0]]
            shards.append(
                BucketShard(
                    index=b,
                    numel=total,
                    shard_numel=size,
                    lo=lo,
                    hi=hi,
                    members=tuple(zip(members, offsets, strict=True)),
                    pieces=tuple(pieces),
                    dtype=first.dtype,
                    device=first.device,
                )
            )
        return cls(degree=degree, index=index, buckets=tuple(shards))

    @property
    def owned_numel(self) -> int:
        """Elements this rank owns over all buckets."""
        return sum(b.hi - b.lo for b in self.buckets)

    def stepped(self) -> list[tuple[BucketShard, Piece]]:
        """The pieces the optimizer steps (those of its parameters), in bucket order."""
        return [(s, p) for s in self.buckets for p in s.pieces if p.group is not None]


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as one flat tensor in memory order (a view: writes reach ``t``), the
    order the reducer lays gradients out in. ValueError for a tensor with gaps."""
    if t.is_contiguous():
        return t.view(-1)
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda p: p[1]):
        if size != 1 and stride != expected:
            raise ValueError(
                f"a tensor of shape {tuple(t.shape)} with strides {t.stride()} has gaps: "
                "sharding needs dense parameters (call .contiguous() on the parameter)"
            )
        expected *= size
    return t.as_strided((t.numel(),), (1,), t.storage_offset())
