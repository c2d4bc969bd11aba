"""Horovod's gradient compression classes: ``Compression.none`` and ``Compression.fp16``.

``compress``/``decompress`` have Horovod's signatures, so a script's own Compressor subclass
keeps working with ``hvd.allreduce``. ``core_name`` names the longboat compressor
(``longboat.comm.compress``) that ``DistributedOptimizer`` uses in its fused buckets.
"""

from __future__ import annotations

from typing import Any

import torch


class Compressor:
    """Interface: ``compress(tensor) -> (tensor, ctx)``; ``decompress(tensor, ctx) -> tensor``."""

    core_name: str | None = None

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression."""

    core_name = "none"

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor(Compressor):
    """Send floating-point tensors as float16; restore the original dtype on arrival."""

    core_name = "fp16"

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point:
            return tensor.type(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor if ctx is None or tensor.dtype == ctx else tensor.type(ctx)


class Compression:
    """The compressors a script can pick: ``Compression.none``, ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
