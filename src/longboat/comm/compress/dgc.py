"""dgc: Deep Gradient Compression (Lin et al., 2018), Fleet's ``dgc`` / ``dgc_configs``.

Each rank keeps, per gradient entry, a momentum ``u`` and an accumulation ``v``::

    u ← m·u + g          (momentum correction: momentum is applied before sparsification)
    v ← v + u            (local accumulation: what was not sent keeps growing)
    send the k entries of v with the largest |v|, as (index, value) pairs, by allgather
    u[sent] ← 0, v[sent] ← 0            (momentum factor masking)

and every rank adds all ranks' pairs into the bucket: the sum of the sparse ``v`` is the step
the optimizer then takes *without* its own momentum (the optimizer glue in
``longboat.collective.optimizer`` switches SGD's momentum off while DGC is sparse). Tensors
below ``min_numel`` entries (biases, norms, small layers) are not sparsified: they get the
same momentum ``u`` and are allreduced dense, which is exactly momentum SGD for them.

Warm-up follows Fleet: the first ``rampup_begin_step`` calls of a bucket are plain
allreduces (the optimizer's momentum applies); then the sparsity walks through the list
``sparsity`` over ``rampup_step`` steps and stays at its last value. Buckets hold
``grad / N`` already, so every exchange is a plain sum.

Bytes per sparse step (this rank): the dense part's ring allreduce ``2·S·(N−1)/N`` plus the
allgather of this rank's pairs to ``N−1`` peers: ``(N−1)·2·k·itemsize``. At sparsity 0.999
on 2 ranks the sparsified tensors cost 0.2 % of their dense allreduce. The bucket's layout (``set_layout``, given by
``lb.distribute``) says where each gradient lies; without one the bucket is one tensor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from longboat.comm.algorithms import AllreduceFn
from longboat.comm.compress import (
    Bucket,
    CompressorStats,
    ThreadedCompressor,
    Wire,
    check_config,
    register_compressor,
    ring_bytes,
)
from longboat.comm.handles import wait_for
from longboat.strategy.values import Config, Float, FloatList, Int, KeySpec

CONFIG = Config(
    (
        KeySpec("rampup_begin_step", Int(0), 0, "step at which gradient compression starts"),
        KeySpec("rampup_step", Int(1), 1, "steps over which sparsity ramps up"),
        KeySpec(
            "sparsity",
            FloatList(Float(0, 1, hi_open=True)),
            [0.999],
            "sparsity schedule during ramp-up (fraction of gradient entries dropped)",
        ),
        KeySpec(
            "min_numel",
            Int(1),
            16384,
            "tensors with fewer elements are sent dense, not sparsified (longboat's key)",
        ),
    )
)
"""The keys of ``Strategy.dgc_configs``, with their defaults."""
DEFAULTS: dict[str, Any] = {**CONFIG.defaults(), "momentum": 0.0}  # momentum: the optimizer's

_INDEX_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64}
_Key = tuple[int, int, torch.dtype, torch.device]
Layout = Sequence[tuple[int, torch.Size]]


@dataclass
class _BucketState:
    """Per bucket: which ranges are sparsified, the momentum/accumulation, a call count."""

    sparse: list[tuple[int, int]]  # (offset, numel)
    dense: list[tuple[int, int]]
    u: torch.Tensor
    v: torch.Tensor
    steps: int = 0


def sparsity_at(step: int, config: Mapping[str, Any]) -> float | None:
    """Fleet's schedule: None (dense) before ``rampup_begin_step``, then the list's values."""
    begin, ramp, levels = config["rampup_begin_step"], config["rampup_step"], config["sparsity"]
    if step < begin:
        return None
    index = min(len(levels) - 1, (step - begin) * len(levels) // max(ramp, 1))
    return float(levels[index])


def kept(numel: int, sparsity: float) -> int:
    """How many entries of a ``numel``-entry tensor are sent at ``sparsity`` (at least 1)."""
    return max(1, math.ceil(numel * (1.0 - sparsity)))


class DGC:
    """Blocking in-place DGC exchange of one bucket; run on a worker by the wrapper."""

    def __init__(self, inner: AllreduceFn, group: dist.ProcessGroup, config: Mapping[str, Any]):
        cfg = check_config("dgc", config, DEFAULTS)
        if not cfg["sparsity"] or not all(0.0 <= s < 1.0 for s in cfg["sparsity"]):
            raise ValueError(f"dgc sparsity must be values in [0, 1), got {cfg['sparsity']!r}")
        if not 0.0 <= float(cfg["momentum"]) < 1.0:
            raise ValueError(f"dgc momentum must be in [0, 1), got {cfg['momentum']!r}")
        self.config = cfg
        self.inner = inner
        self.group = group
        self.world_size = group.size()
        self.momentum = float(cfg["momentum"])
        self.stats = CompressorStats()
        self.sparse_active = False  # has a sparse step happened (optimizer momentum off)?
        self._layouts: dict[_Key, Layout] = {}
        self._states: dict[_Key, _BucketState] = {}

    @staticmethod
    def _key(tensor: torch.Tensor) -> _Key:
        return (tensor.data_ptr(), tensor.numel(), tensor.dtype, tensor.device)

    def set_layout(self, bucket: torch.Tensor, layout: Layout) -> None:
        """Sparsify ``bucket`` per parameter: ``layout`` lists each one's (offset, shape)."""
        self._layouts[self._key(bucket)] = list(layout)

    def _state(self, tensor: torch.Tensor) -> _BucketState:
        key = self._key(tensor)
        state = self._states.get(key)
        if state is None:
            layout = self._layouts.get(key, [(0, tensor.shape)])
            sparse, dense = [], []
            covered = 0
            for offset, shape in layout:
                numel = math.prod(shape)
                big = numel >= self.config["min_numel"]
                (sparse if big else dense).append((offset, numel))
                covered = max(covered, offset + numel)
            if covered < tensor.numel():
                dense.append((covered, tensor.numel() - covered))
            if tensor.dtype not in _INDEX_VIEW:  # half precision: no sparse exchange
                dense, sparse = sorted(dense + sparse), []
            zeros = torch.zeros_like(tensor)
            state = self._states[key] = _BucketState(sparse, dense, zeros, zeros.clone())
        return state

    def residual(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """This rank's unsent accumulation ``v`` for bucket ``tensor`` (a copy)."""
        state = self._states.get(self._key(tensor))
        return None if state is None else state.v.clone()

    def __call__(self, tensor: torch.Tensor) -> None:
        floating = tensor.is_floating_point() and tensor.numel() > 0 and self.world_size > 1
        state = self._state(tensor) if floating else None
        step = state.steps if state is not None else 0
        sparsity = sparsity_at(step, self.config) if state is not None else None
        if state is None or sparsity is None:
            if state is not None:
                state.steps += 1
            self.stats.record(
                ring_bytes(tensor.numel() * tensor.element_size(), self.world_size), False
            )
            wait_for(self.inner(tensor))
            return
        state.steps += 1
        self.sparse_active = True
        flat = tensor.detach().view(-1)
        state.u.mul_(self.momentum).add_(flat)  # momentum correction, every entry
        sent = self._dense(flat, state) + self._sparse(flat, state, sparsity)
        self.stats.record(sent, bool(state.sparse))

    def _dense(self, flat: torch.Tensor, state: _BucketState) -> int:
        """Allreduce the small tensors' momentum ``u``: plain momentum SGD for them."""
        if not state.dense:
            return 0
        parts = [state.u[o : o + n] for o, n in state.dense]
        buffer = torch.cat(parts)
        wait_for(self.inner(buffer))
        at = 0
        for o, n in state.dense:
            flat[o : o + n].copy_(buffer[at : at + n])
            at += n
        return ring_bytes(buffer.numel() * buffer.element_size(), self.world_size)

    def _sparse(self, flat: torch.Tensor, state: _BucketState, sparsity: float) -> int:
        """Top-k of ``v`` per tensor, allgathered as (values, indices) and summed in place."""
        if not state.sparse:
            return 0
        values, indices = [], []
        for o, n in state.sparse:
            v = state.v[o : o + n]
            v.add_(state.u[o : o + n])
            top = torch.topk(v.abs(), kept(n, sparsity), sorted=False).indices
            values.append(v[top])
            indices.append(top + o)
            # sent: the accumulation and the momentum restart there (a kernel: ``v[top] = 0.0``
            # would copy a host scalar into device memory and stall the host)
            v.index_fill_(0, top, 0.0)
            state.u[o : o + n].index_fill_(0, top, 0.0)
        index = torch.cat(indices)
        pack = torch.cat([torch.cat(values), index.to(_INDEX_VIEW[flat.dtype]).view(flat.dtype)])
        gathered = [torch.empty_like(pack) for _ in range(self.world_size)]
        dist.all_gather(gathered, pack, group=self.group)
        for o, n in state.sparse:
            flat[o : o + n].zero_()
        k = index.numel()
        for other in gathered:
            where = other[k:].view(_INDEX_VIEW[flat.dtype]).to(torch.int64)
            flat.index_add_(0, where, other[:k])
        return (self.world_size - 1) * pack.numel() * pack.element_size()


def cost(bucket: Bucket) -> Wire:
    """At the schedule's last sparsity: gradients of at least ``min_numel`` entries send
    ``k = ceil(numel·(1 − sparsity))`` (value, index) float32 pairs by all-gather, the others
    one dense allreduce; six passes over the sparsified bytes (momentum, accumulation, top-k).
    Kept per rank: the momentum ``u`` and accumulation ``v`` of every sparsified entry."""
    sparsity = float(list(bucket.config.get("sparsity", DEFAULTS["sparsity"]))[-1])
    min_numel = int(bucket.config.get("min_numel", DEFAULTS["min_numel"]))
    dense = bucket.extra_bytes + sum(g.nbytes for g in bucket.grads if g.numel < min_numel)
    pairs = sum(kept(g.numel, sparsity) for g in bucket.grads if g.numel >= min_numel)
    sparse = bucket.nbytes - dense
    return Wire(
        (dense,) if dense else (), allgather=2 * pairs * 4, memory=6 * sparse, state=2 * sparse
    )


@register_compressor(
    "dgc",
    config=CONFIG,
    lossy=True,
    switch="dgc",
    title="deep-gradient-compression",
    momentum=True,
    elastic=False,
    state="residuals and momentum",
    cost=cost,
)
def make_dgc(
    inner: AllreduceFn, group: dist.ProcessGroup, config: Mapping[str, Any]
) -> AllreduceFn:
    """DGC over ``inner``; config keys and defaults in ``DEFAULTS``."""
    return ThreadedCompressor(DGC(inner, group, config), "dgc")
