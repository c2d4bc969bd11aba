"""Bucket planner: which gradients are fused into one allreduce, and in which order; and what
reducing a bucket is (`BucketCollective`: `Allreduce`, or sharding's reduce-scatter).

Buckets follow reverse registration order, the order in which backward produces gradients,
so the first bucket is ready first and its allreduce overlaps the rest of backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from longboat.comm.algorithms import AllreduceFn, Handle
from longboat.words import plural

MB = 1024 * 1024


@dataclass(frozen=True)
class GradSpec:
    """What the planner needs to know about one parameter."""

    index: int  # position in registration order
    name: str
    numel: int
    dtype: torch.dtype
    device: torch.device
    layer: str  # owning module's qualified name; a "layer" for the per-bucket layer cap

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class BucketPlan:
    """Buckets as lists of parameter indices, in launch order."""

    buckets: tuple[tuple[int, ...], ...]
    cap_bytes: int
    max_layers: int
    fused: bool
    cap_mb: float | None = None
    """The cap as the user gave it, in MB (``cap_bytes`` is it rounded down to bytes); None:
    ``cap_bytes`` in MB."""

    def __len__(self) -> int:
        return len(self.buckets)

    def describe(self, num_grads: int, collective: str = "allreduce") -> str:
        """One line for the log: ``num_grads`` gradients in these buckets, each reduced by
        ``collective`` (`BucketCollective.name`)."""
        grads = plural(num_grads, "gradient tensor")
        buckets = plural(len(self), f"{collective} bucket")
        if not self.fused:
            return f"fusion off: {grads} in {buckets}"
        cap = self.cap_mb if self.cap_mb is not None else self.cap_bytes / MB
        layers = plural(self.max_layers, "layer")
        return f"fused {grads} into {buckets} ({cap:g} MB cap, at most {layers} per bucket)"


def layer_of(param_name: str) -> str:
    """The owning module of ``a.b.weight`` is ``a.b``."""
    return param_name.rpartition(".")[0]


def plan_buckets(
    specs: list[GradSpec],
    *,
    fuse: bool = True,
    cap_mb: float = 32.0,
    max_layers: int = 20,
    last_cap_mb: float = 1.0,
) -> BucketPlan:
    """Group gradients into buckets.

    ``specs`` are in registration order. With ``fuse`` off every gradient is its own bucket.
    Otherwise gradients are packed greedily in reverse order into buckets of at most
    ``cap_mb`` megabytes and ``max_layers`` distinct layers (Fleet's
    ``fuse_grad_size_in_TFLOPS``), never mixing dtypes or devices; a gradient larger than
    the cap gets a bucket of its own. The model's first parameters, whose gradients come
    last, form the final group(s) of at most ``last_cap_mb`` (Fleet's
    ``last_comm_group_size_MB``) so the allreduce that ends backward is short, unless
    everything before that group is smaller than the group itself (nothing to overlap).
    """
    cap = max(1, int(cap_mb * MB))
    ordered = list(reversed(specs))
    if not fuse:
        buckets = tuple((s.index,) for s in ordered)
        return BucketPlan(buckets, cap, max_layers, fused=False, cap_mb=cap_mb)
    last_cap = max(1, int(last_cap_mb * MB))
    tail = _take_tail(specs, last_cap)
    head = ordered[: len(ordered) - len(tail)]
    if sum(s.nbytes for s in head) < last_cap:
        # a tiny model: the rest is smaller than the last group itself, so there is nothing
        # worth overlapping, and a second latency-bound collective would only cost time
        packed = tuple(_greedy(ordered, cap, max_layers))
        return BucketPlan(packed, cap, max_layers, fused=True, cap_mb=cap_mb)
    buckets = _greedy(head, cap, max_layers) + _greedy(list(reversed(tail)), cap, max_layers)
    return BucketPlan(tuple(buckets), cap, max_layers, fused=True, cap_mb=cap_mb)


def _take_tail(specs: list[GradSpec], last_cap: int) -> list[GradSpec]:
    """The leading whole layers (registration order) that fit in ``last_cap`` bytes.

    At least one layer. Layers are never split: a layer's tensors get their gradients at
    the same moment, so a bucket holding half of one would wait as long as the other half.
    """
    tail: list[GradSpec] = []
    size = 0
    i = 0
    while i < len(specs):
        j = i
        while j < len(specs) and specs[j].layer == specs[i].layer:
            j += 1
        layer_bytes = sum(s.nbytes for s in specs[i:j])
        if tail and size + layer_bytes > last_cap:
            break
        tail.extend(specs[i:j])
        size += layer_bytes
        i = j
    return tail


def _greedy(specs: list[GradSpec], cap: int, max_layers: int) -> list[tuple[int, ...]]:
    """Pack whole layers into buckets of at most ``cap`` bytes and ``max_layers`` layers.

    A layer's tensors get their gradients at the same moment, so they share a bucket: a
    layer that does not fit closes the current bucket and starts the next. A layer larger
    than the cap is cut, at tensor boundaries, into pieces of at least ``cap`` bytes, so a
    bias never travels alone beside its weight.
    """
    buckets: list[tuple[int, ...]] = []
    current: list[GradSpec] = []
    size = 0
    layers = 0

    def close() -> None:
        nonlocal current, size, layers
        if current:
            buckets.append(tuple(s.index for s in current))
        current, size, layers = [], 0, 0

    for group in _layer_groups(specs):
        group_bytes = sum(s.nbytes for s in group)
        fits = (
            current
            and group[0].dtype == current[0].dtype
            and group[0].device == current[0].device
            and size + group_bytes <= cap
            and layers + 1 <= max_layers
        )
        if not fits:
            close()
        layers += 1
        rest = group_bytes
        for spec in group:
            if size >= cap and rest >= cap:  # only inside a layer larger than the cap
                close()
                layers = 1
            current.append(spec)
            size += spec.nbytes
            rest -= spec.nbytes
    close()
    return buckets


def _layer_groups(specs: list[GradSpec]) -> list[list[GradSpec]]:
    """Runs of consecutive gradients of one layer, dtype and device."""
    groups: list[list[GradSpec]] = []
    for spec in specs:
        last = groups[-1][-1] if groups else None
        if last and (last.layer, last.dtype, last.device) == (spec.layer, spec.dtype, spec.device):
            groups[-1].append(spec)
        else:
            groups.append([spec])
    return groups


def assign_communicators(bucket_bytes: list[int], communicators: int) -> list[int]:
    """The communicator of each bucket: the one with the fewest bytes assigned so far.

    Deterministic (sizes only), so every rank picks the same. Round-robin would queue every
    large bucket of a model that alternates small and large ones (bias-only layers, norms)
    on one communicator while the other idles.
    """
    load = [0] * max(1, communicators)
    chosen: list[int] = []
    for nbytes in bucket_bytes:
        comm = min(range(len(load)), key=lambda c: (load[c], c))
        load[comm] += nbytes
        chosen.append(comm)
    return chosen


class BucketCollective(Protocol):
    """What reducing one packed bucket is: `Allreduce`, or sharding stage 2's reduce-scatter
    into this rank's slice (`longboat.sharding.zero.scatter.SliceScatter`)."""

    name: str
    """What the log calls it: ``allreduce``, ``reduce-scatter``."""

    keeps_buffers: bool
    """True: the result is the bucket buffer itself, kept between backwards, and ``.grad``
    views it after backward. False: the result lands elsewhere: each pack takes a fresh
    buffer from `buffer`, the packed parameters' ``.grad`` are dropped, and the buffers are
    released when backward ends (the used-parameter flags then travel apart)."""

    bytes_sent: int
    """Bytes this collective counted itself (the allreduce's are counted by its functions)."""

    def buffer(self, bucket: int) -> torch.Tensor:
        """A fresh buffer to pack bucket ``bucket`` into (asked only if not `keeps_buffers`)."""
        ...

    def launch(self, bucket: int, comm: int, buffer: torch.Tensor) -> Handle:
        """Start reducing the packed ``buffer`` of bucket ``bucket`` (on communicator ``comm``)."""
        ...

    def all_finite(self, buffers: Sequence[torch.Tensor]) -> torch.Tensor:
        """On the device, the same on every rank: are the reduced gradients free of inf/NaN?
        ``buffers``: each bucket's packed elements (the result where `keeps_buffers`)."""
        ...

    def clip_grad_norm_(
        self, params: Sequence[torch.Tensor], max_norm: float, norm_type: float
    ) -> torch.Tensor:
        """Clip the reduced gradients by their global norm, as ``clip_grad_norm_`` would."""
        ...


class Allreduce:
    """Each bucket is allreduced in place on its communicator (``fns[comm]``)."""

    name = "allreduce"
    keeps_buffers = True
    bytes_sent = 0  # counted by the allreduce functions (the compressors)

    def __init__(self, fns: Sequence[AllreduceFn]) -> None:
        self.fns = list(fns)

    def buffer(self, bucket: int) -> torch.Tensor:
        raise RuntimeError("an allreduce reduces the reducer's own bucket buffers")

    def launch(self, bucket: int, comm: int, buffer: torch.Tensor) -> Handle:
        return self.fns[comm](buffer)

    def all_finite(self, buffers: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.stack([torch.isfinite(b).all() for b in buffers]).all()

    def clip_grad_norm_(
        self, params: Sequence[torch.Tensor], max_norm: float, norm_type: float
    ) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(list(params), max_norm, norm_type)
