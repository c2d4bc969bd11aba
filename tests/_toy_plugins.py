"""A toy allreduce algorithm and a toy gradient compressor, registered from outside src/.

Both count their calls into files under ``$TOY_PLUGIN_DIR`` (one line per call, one file per
kind and rank) and otherwise change nothing, so training equals the plain one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from longboat.comm.algorithms import AllreduceFn, Handle, register
from longboat.comm.compress import CompressorStats, check_config, register_compressor, ring_bytes
from longboat.strategy.values import Config, Int, KeySpec

ALGORITHM = "toy_allreduce"
COMPRESSOR = "toy_identity"
TOY_CONFIG = Config((KeySpec("tag", Int(0), 0, "a number the toy compressor writes per call"),))


def _count(kind: str, text: str = "") -> None:
    folder = os.environ.get("TOY_PLUGIN_DIR")
    if folder:
        with Path(folder, f"{kind}.{dist.get_rank()}").open("a") as out:
            out.write(f"{text}\n")


@register(ALGORITHM)
def make_toy_allreduce(group: dist.ProcessGroup) -> AllreduceFn:
    """The backend's allreduce, counting each call."""

    def allreduce(tensor: torch.Tensor) -> Handle:
        _count(ALGORITHM)
        return dist.all_reduce(tensor, group=group, async_op=True)

    return allreduce


class ToyIdentity:
    """``inner`` unchanged, with byte counters, counting each call."""

    def __init__(self, inner: AllreduceFn, group: dist.ProcessGroup, tag: int) -> None:
        self.inner = inner
        self.tag = tag
        self.world_size = group.size()
        self.stats = CompressorStats()

    def __call__(self, tensor: torch.Tensor) -> Handle:
        _count(COMPRESSOR, str(self.tag))
        nbytes = tensor.numel() * tensor.element_size()
        self.stats.record(ring_bytes(nbytes, self.world_size), False)
        return self.inner(tensor)


@register_compressor(COMPRESSOR, config=TOY_CONFIG, title="toy identity")
def make_toy_identity(
    inner: AllreduceFn, group: dist.ProcessGroup, config: Mapping[str, Any]
) -> AllreduceFn:
    """Sends buckets unchanged and counts the calls (a test plugin)."""
    cfg = check_config(COMPRESSOR, config, TOY_CONFIG.defaults())
    return ToyIdentity(inner, group, int(cfg["tag"]))
