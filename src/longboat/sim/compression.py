"""Bytes on the wire and extra work of each gradient compressor, for one bucket.

Returns the bucket's communication as (latency, link) seconds (see `longboat.sim.cost`),
the compressor's own work counted as latency on its communicator (it runs on the
communicator's worker thread, before and after the collectives):

* ``none``: one allreduce of the bucket;
* ``fp16`` / ``bf16``: one allreduce of half the bytes, plus two casts (12 bytes per entry
  through memory);
* ``powersgd`` (steady state, after ``start_step``): per matrix parameter whose rank-r factors
  are smaller, ``rows*r`` then ``cols*r`` float32 entries in two allreduces (uncompressed
  parameters ride in the first), plus ``4 rows cols r`` FLOPs and three passes for error feedback;
  buckets below ``min_compression_bytes`` go uncompressed;
* ``dgc`` (at the last sparsity of the schedule): parameters of at least ``min_numel`` entries
  send ``k = ceil(numel (1 - sparsity))`` (value, index) pairs by all-gather, the others one dense
  allreduce; plus six passes for momentum, accumulation and top-k.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from longboat.sim import cost
from longboat.sim.cluster import Cluster
from longboat.sim.profile import Param

Parts = cost.Parts


def _add(a: Parts, b: Parts) -> Parts:
    return a[0] + b[0], a[1] + b[1]


def bucket_parts(
    members: Sequence[Param],
    extra_bytes: int,
    cluster: Cluster,
    algorithm: str,
    compression: str,
    config: Mapping[str, Any],
    flop_rate: float,
) -> tuple[Parts, int]:
    """(latency, link) seconds of one bucket and the bytes this rank puts on the wire."""
    nbytes = sum(p.nbytes for p in members) + extra_bytes
    numel = nbytes // 4
    n = cluster.world
    ring = 2 * (n - 1) / n if n > 1 else 0.0
    if n <= 1:
        return (0.0, 0.0), 0
    if compression in ("fp16", "bf16"):
        lat, bw = cost.allreduce(nbytes / 2, cluster, algorithm)
        return (lat + 12 * numel / cluster.mem_bw, bw), int(ring * nbytes / 2)
    if compression == "powersgd" and nbytes >= int(config.get("min_compression_bytes", 65536)):
        r = int(config.get("rank", 1))
        first, second, flops = extra_bytes / 4, 0.0, 0.0
        for p in members:
            rows = p.shape[0] if len(p.shape) >= 2 else 1
            cols = p.numel // max(rows, 1)
            k = min(r, rows, cols)
            if len(p.shape) >= 2 and (rows + cols) * k < p.numel:
                first += rows * k
                second += cols * k
                flops += 4 * rows * cols * k
            else:
                first += p.numel
        parts = _add(
            cost.allreduce(first * 4, cluster, algorithm),
            cost.allreduce(second * 4, cluster, algorithm),
        )
        work = flops / flop_rate + 3 * nbytes / cluster.mem_bw
        return (parts[0] + work, parts[1]), int(ring * (first + second) * 4)
    if compression == "dgc":
        sparsity = float(list(config.get("sparsity", [0.999]))[-1])
        min_numel = int(config.get("min_numel", 16384))
        dense = extra_bytes + sum(p.nbytes for p in members if p.numel < min_numel)
        kept = sum(
            max(1, math.ceil(p.numel * (1 - sparsity))) for p in members if p.numel >= min_numel
        )
        parts = cost.allreduce(dense, cluster, algorithm) if dense else (0.0, 0.0)
        if kept:
            parts = _add(parts, cost.allgather(2 * kept * 4, cluster))
        work = 6 * (nbytes - dense) / cluster.mem_bw
        return (parts[0] + work, parts[1]), int(ring * dense + (n - 1) * 2 * kept * 4)
    return cost.allreduce(nbytes, cluster, algorithm), int(ring * nbytes)
