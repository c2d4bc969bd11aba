"""Bytes on the wire and extra work of the gradient compressor, for one bucket.

Each compressor declares its cost where it is registered (``register_compressor(cost=...)``:
`longboat.comm.compress.Wire` of one `longboat.comm.compress.Bucket`); nothing here knows a
compressor by name. The bucket's communication comes back as (latency, link) seconds (see
`longboat.sim.cost`): each declared allreduce priced by the Strategy's algorithm, the
all-gather by the cluster's links, and the compressor's own work (its memory passes at the
memory bandwidth, its FLOPs at the device's rate) counted as latency on its communicator (it
runs on the communicator's worker thread, before and after the collectives). A compressor that
declares no cost is priced as if it sent the bucket as it is, and the prediction says so
(:func:`unpriced_note`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from longboat.comm.compress import Bucket, Wire, scaled_cost
from longboat.registry import COMPRESSORS
from longboat.sim import cost
from longboat.sim.cluster import Cluster
from longboat.sim.profile import Param

Parts = cost.Parts
_UNCOMPRESSED = scaled_cost(1)
UNPRICED = "has no declared cost; priced as uncompressed"
"""In the note of a prediction whose compressor declares no cost (printed under its table)."""


@dataclass(frozen=True)
class BucketCost:
    """One bucket's (latency, link) seconds, the bytes this rank sends, the state it keeps."""

    parts: Parts
    sent: int
    state: float


def _add(a: Parts, b: Parts) -> Parts:
    return a[0] + b[0], a[1] + b[1]


def model(compression: str) -> Callable[[Bucket], Wire]:
    """The cost ``compression`` declared; the uncompressed one where it declared none."""
    declared = COMPRESSORS.entry(compression).cost
    return declared if declared is not None else _UNCOMPRESSED


def unpriced_note(compression: str) -> str | None:
    """The line a prediction carries when ``compression`` declares no cost, else None."""
    if COMPRESSORS.entry(compression).cost is not None:
        return None
    return (
        f"compressor {compression!r} {UNPRICED} (declare its cost: register_compressor(..., "
        "cost=...), docs/compression.md)"
    )


def bucket_parts(
    members: Sequence[Param],
    extra_bytes: int,
    cluster: Cluster,
    algorithm: str,
    compression: str,
    config: Mapping[str, Any],
    flop_rate: float,
) -> BucketCost:
    """What one bucket costs under ``compression``'s declared `Wire`."""
    n = cluster.world
    if n <= 1:
        return BucketCost((0.0, 0.0), 0, 0.0)
    ring = 2 * (n - 1) / n
    wire = model(compression)(Bucket(members, extra_bytes, n, config))
    parts: Parts = (0.0, 0.0)
    for nbytes in wire.allreduces:
        parts = _add(parts, cost.allreduce(nbytes, cluster, algorithm))
    if wire.allgather:
        parts = _add(parts, cost.allgather(wire.allgather, cluster))
    work = (wire.flops / flop_rate if wire.flops else 0.0) + wire.memory / cluster.mem_bw
    sent = int(ring * sum(wire.allreduces) + (n - 1) * wire.allgather)
    return BucketCost((parts[0] + work, parts[1]), sent, wire.state)
