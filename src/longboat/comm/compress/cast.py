"""fp16 / bf16: allreduce a half-precision copy of the bucket (Fleet's ``fp16_allreduce``).

The bucket is cast to half precision, allreduced with the inner algorithm, and cast back into
the original tensor when the inner allreduce completes (a future callback; the caller never
blocks). On a GPU the callback runs on a stream that waits for the allreduce, and the half
copy is recorded on that stream so the caching allocator cannot hand its memory out before the
cast back has read it. Buckets hold ``grad / world_size`` already, so every partial sum of the allreduce is
bounded by the largest per-rank gradient: summing cannot overflow fp16 where the gradients
themselves fit (|g| <= 65504). What fp16 can lose is range at the small end (values below
~6e-8 flush to zero, below ~6e-5 lose precision); bf16 keeps float32's range with an 8-bit
mantissa. Buckets that are not float32/float64 pass through unchanged. ``none`` passes every
bucket through and only counts bytes (a baseline).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from longboat.comm.algorithms import AllreduceFn, Handle
from longboat.comm.compress import (
    CompressorStats,
    check_config,
    close_inner,
    register_compressor,
    ring_bytes,
    scaled_cost,
)
from longboat.comm.handles import chain

_CASTABLE = (torch.float32, torch.float64)
_HALF_COST = scaled_cost(0.5, memory_per_entry=12)
"""Half the bytes; two casts move 12 bytes per entry (read 4, write 2; read 2, write 4)."""


class CastCompressor:
    """Allreduce ``tensor`` as ``wire_dtype`` (None: as is), in place, asynchronously."""

    def __init__(
        self, inner: AllreduceFn, group: dist.ProcessGroup, wire_dtype: torch.dtype | None
    ):
        self.inner = inner
        self.wire_dtype = wire_dtype
        self.world_size = group.size()
        self.stats = CompressorStats()

    def __call__(self, tensor: torch.Tensor) -> Handle:
        if self.wire_dtype is None or tensor.dtype not in _CASTABLE or tensor.numel() == 0:
            self.stats.record(
                ring_bytes(tensor.numel() * tensor.element_size(), self.world_size), False
            )
            return self.inner(tensor)
        wire = tensor.detach().to(self.wire_dtype).contiguous()
        self.stats.record(ring_bytes(wire.numel() * wire.element_size(), self.world_size), True)
        handle = self.inner(wire)

        def cast_back() -> torch.Tensor:
            if wire.is_cuda:  # read on this (callback) stream: not reused before it has been
                wire.record_stream(torch.cuda.current_stream(wire.device))
            return tensor.copy_(wire.view(tensor.shape))

        return chain(handle, cast_back)

    def close(self) -> None:
        """Close ``inner`` if it has a ``close()`` (this wrapper holds no thread)."""
        close_inner(self.inner)


@register_compressor("fp16", cost=_HALF_COST)
def make_fp16(
    inner: AllreduceFn, group: dist.ProcessGroup, config: Mapping[str, Any]
) -> AllreduceFn:
    """Allreduce float32/float64 buckets as float16: half the bytes."""
    check_config("fp16", config, {})
    return CastCompressor(inner, group, torch.float16)


@register_compressor("bf16", cost=_HALF_COST)
def make_bf16(
    inner: AllreduceFn, group: dist.ProcessGroup, config: Mapping[str, Any]
) -> AllreduceFn:
    """Allreduce float32/float64 buckets as bfloat16: half the bytes, float32's range."""
    check_config("bf16", config, {})
    return CastCompressor(inner, group, torch.bfloat16)


@register_compressor("none", cost=scaled_cost(1))
def make_none(
    inner: AllreduceFn, group: dist.ProcessGroup, config: Mapping[str, Any]
) -> AllreduceFn:
    """No compression: ``inner`` itself, with byte counters."""
    check_config("none", config, {})
    return CastCompressor(inner, group, None)
