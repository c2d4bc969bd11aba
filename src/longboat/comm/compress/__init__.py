"""Gradient compressors: AllreduceFn wrappers, registered by name.

A compressor is a factory ``(inner, group, config) -> AllreduceFn``: the returned callable
starts the same in-place SUM allreduce as ``inner`` (on bucket buffers that already hold
``grad / world_size``), but puts fewer bytes on the wire, and returns a handle at once. Every
compressor returned here carries ``.stats`` (:class:`CompressorStats`): the bytes this rank
sent, counted with the ring model ``2·S·(N−1)/N`` for an allreduce of ``S`` bytes over ``N``
ranks. Adding one means a module with one ``@register_compressor`` factory whose declaration
carries its config keys and defaults (the Strategy's ``<name>_configs``), whether it is lossy,
what it needs from the engine (``momentum``, ``elastic``, ``state``: see
`longboat.registry.Entry`) and its cost for ``longboat sim`` (``cost``: a function of one
:class:`Bucket` returning its :class:`Wire`); see ``docs/compression.md``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from longboat.comm.algorithms import AllreduceFn, Handle
from longboat.comm.background import AsyncAllreduce
from longboat.comm.handles import wait_for
from longboat.registry import COMPRESSORS

CompressorFactory = Callable[[AllreduceFn, dist.ProcessGroup, Mapping[str, Any]], AllreduceFn]

register_compressor = COMPRESSORS.register  # decorator: selectable as compressor ``name``
compressor_names = COMPRESSORS.names


class Grad(Protocol):
    """One gradient of a bucket as a cost model sees it (``longboat sim``'s profiled
    parameter)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def numel(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


@dataclass(frozen=True)
class Bucket:
    """One bucket, as a compressor's cost model (``register_compressor(cost=...)``) sees it."""

    grads: Sequence[Grad]  # its gradients, in bucket order (their shapes, entries and bytes)
    extra_bytes: int  # bytes beyond the gradients (the used-parameter flags ride in the last)
    world: int  # ranks in the allreduce
    config: Mapping[str, Any]  # the compressor's ``<name>_configs``, as plain values

    @property
    def nbytes(self) -> int:
        """Bytes of the uncompressed bucket (gradients and extra)."""
        return sum(g.nbytes for g in self.grads) + self.extra_bytes

    @property
    def entries(self) -> int:
        """Its float32 entries (what a cast reads and writes per entry)."""
        return self.nbytes // 4


@dataclass(frozen=True)
class Wire:
    """What a compressor does with one bucket: ``longboat sim`` prices each allreduce with the
    Strategy's algorithm, the all-gather with the cluster's links, and the compressor's own
    work as time on its communicator (``memory`` at the memory bandwidth, ``flops`` at the
    device's rate)."""

    allreduces: tuple[float, ...]  # bytes of each allreduce it starts, in order
    allgather: float = 0.0  # bytes each rank contributes to one all-gather (0: none)
    memory: float = 0.0  # bytes its own passes read and write (casts, top-k, error feedback)
    flops: float = 0.0  # its own arithmetic (e.g. low-rank matrix products)
    state: float = 0.0  # bytes kept per rank between steps (residuals, momentum, factors)


CompressorCost = Callable[[Bucket], Wire]


def scaled_cost(
    ratio: float, memory_per_entry: float = 0.0, residual: bool = False
) -> CompressorCost:
    """The cost of a compressor that sends ``ratio`` of each bucket's bytes in one allreduce,
    moves ``memory_per_entry`` bytes through memory per float32 entry, and (``residual``) keeps
    an error-feedback buffer the size of the bucket: e.g. ``scaled_cost(1 / 32, 16, True)`` for
    1-bit signs with error feedback."""

    def cost(bucket: Bucket) -> Wire:
        nbytes = bucket.nbytes
        memory = memory_per_entry * bucket.entries
        return Wire((nbytes * ratio,), memory=memory, state=nbytes if residual else 0.0)

    return cost


def make_compressor(
    name: str,
    inner: AllreduceFn,
    group: dist.ProcessGroup,
    config: Mapping[str, Any] | None = None,
) -> AllreduceFn:
    """Wrap ``inner`` (an AllreduceFn over ``group``) with compressor ``name``."""
    return COMPRESSORS.get(name)(inner, group, dict(config or {}))


@dataclass
class CompressorStats:
    """Bytes this rank put on the wire (ring model), cumulative and for the latest call."""

    bytes_sent: int = 0
    last_bytes_sent: int = 0
    calls: int = 0
    compressed_calls: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, nbytes: int, compressed: bool) -> None:
        with self._lock:
            self.calls += 1
            self.compressed_calls += int(compressed)
            self.last_bytes_sent = nbytes
            self.bytes_sent += nbytes


class Compressor(Protocol):
    """What every factory here returns: an AllreduceFn with byte counters."""

    stats: CompressorStats

    def __call__(self, tensor: torch.Tensor) -> Handle: ...


def ring_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring allreduce of ``nbytes``: ``2·S·(N−1)/N``."""
    if world_size <= 1:
        return 0
    return 2 * nbytes * (world_size - 1) // world_size


def check_config(name: str, config: Mapping[str, Any], allowed: Mapping[str, Any]) -> dict:
    """``allowed`` (key -> default) updated with ``config``; unknown keys raise, named."""
    unknown = sorted(set(config) - set(allowed))
    if unknown:
        raise ValueError(
            f"compressor {name!r} got unknown config key(s) {', '.join(map(repr, unknown))}; "
            f"accepted: {', '.join(sorted(allowed)) or '(none)'}"
        )
    return {**allowed, **config}


def close_inner(inner: AllreduceFn) -> None:
    """Call ``inner.close()`` where the wrapped algorithm has one (worker threads, segments)."""
    close = getattr(inner, "close", None)
    if callable(close):
        close()


class _State(Protocol):
    """A blocking compressor core that a :class:`ThreadedCompressor` runs."""

    inner: AllreduceFn
    stats: CompressorStats
    world_size: int

    def __call__(self, tensor: torch.Tensor) -> None: ...

    def set_layout(self, bucket: torch.Tensor, layout: Any) -> None: ...

    def residual(self, tensor: torch.Tensor) -> torch.Tensor | None: ...


class ThreadedCompressor:
    """A blocking compressor core run in call order on one worker thread (an AllreduceFn).

    ``exact(tensor)`` queues a plain, uncompressed allreduce on the same thread, in order:
    the reducer sends its used-parameter flags that way (a lossy compressor must not touch
    them, and a second thread on the same group would break the collective order).
    """

    def __init__(self, state: _State, name: str):
        self.state = state
        self.stats = state.stats
        self._async = AsyncAllreduce(state, name)

    def __call__(self, tensor: torch.Tensor) -> Handle:
        return self._async(tensor)

    def exact(self, tensor: torch.Tensor) -> Handle:
        return self._async.submit(self._exact, tensor)

    def _exact(self, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.stats.record(ring_bytes(nbytes, self.state.world_size), False)
        wait_for(self.state.inner(tensor))

    def set_layout(self, bucket: torch.Tensor, layout: Any) -> None:
        """Where each parameter lies in ``bucket``: ``[(offset, shape), ...]``."""
        self.state.set_layout(bucket, layout)

    def residual(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """This rank's residual for bucket ``tensor``; call after its handle's ``wait()``."""
        return self.state.residual(tensor)

    def reset(self) -> None:
        """Forget every bucket's state, where the core keeps some; call with no bucket in
        flight (a DDP hook, when DDP has rebuilt its buckets)."""
        reset = getattr(self.state, "reset", None)
        if reset is not None:
            reset()

    def close(self) -> None:
        """Finish queued work and stop the worker thread (call before destroying the group),
        then close ``inner`` if it has a ``close()``."""
        self._async.close()
        close_inner(self.state.inner)
