"""powersgd: rank-r PowerSGD with error feedback (Vogels et al., 2019).

Each gradient is viewed as a matrix ``M`` and one step of power iteration replaces its
allreduce by two small ones::

    M_i = grad_i + e_i                        (e_i: this rank's residual from last step)
    P   = Σ_i M_i Q           allreduce       (Q: cols × r, identical on every rank)
    P̂   = orthonormalise(P)                  (QR; plain normalisation when r = 1)
    Q   = Σ_i M_iᵀ P̂          allreduce
    A   = P̂ Qᵀ = P̂ P̂ᵀ Σ_i M_i                 written back in place of the gradient
    e_i = M_i − A / N                         (so Σ_i e_i = Σ_i M_i − A: nothing is lost)

Which matrices: when the bucket's layout is known (``set_layout``, which ``lb.distribute``
calls with the reducer's buckets), every parameter of two or more dimensions whose rank-r
factors are smaller than itself is its own ``shape[0] × rest`` matrix, as in torch's hook;
the other parameters (biases, norms, small matrices) travel uncompressed in the same first
allreduce as the P factors, so a compressed step is always exactly two allreduces. Without a
layout the whole flat bucket is one padded ``ceil(sqrt(n)) × ceil(n / rows)`` matrix — fine
for a single layer, but one low-rank approximation of a whole model mixes unrelated layers
(with momentum SGD that diverges; per-parameter matrices track uncompressed training).

Buckets hold ``grad / N`` already (the reducer divides before the allreduce), so both
allreduces are plain sums and ``A`` approximates the average gradient directly; the residual
is kept in the same pre-divided units. ``Q`` starts from a seeded normal draw (same seed and
same call order on every rank) and, with ``warm_start``, is reused the next step.

Bytes per compressed step (this rank, ring model): ``2(N−1)/N`` times the uncompressed
entries plus ``Σ (rows + cols)·r`` factor entries, at the compute itemsize (float16/bfloat16
buckets are compressed in float32). A bucket's first ``start_step`` calls are plain
allreduces (warm-up). All work runs on one worker thread in call order, so every rank issues
its inner allreduces in the same order; the caller gets a handle at once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
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
from longboat.strategy.values import Bool, Config, Int, KeySpec

CONFIG = Config(
    (
        KeySpec("rank", Int(1), 1, "rank of the low-rank approximation of each gradient matrix"),
        KeySpec("start_step", Int(0), 10, "plain allreduces before compression starts (warm-up)"),
        KeySpec("warm_start", Bool(), True, "reuse last step's Q instead of a fresh random one"),
        KeySpec("error_feedback", Bool(), True, "carry what compression lost into the next step"),
        KeySpec(
            "min_compression_bytes", Int(0), 64 << 10, "buckets smaller than this go uncompressed"
        ),
        KeySpec("seed", Int(0), 0, "seed of the initial Q (the same on every rank)"),
    )
)
"""The keys of ``Strategy.powersgd_configs``, with their defaults."""
DEFAULTS: dict[str, Any] = CONFIG.defaults()

_Key = tuple[int, int, torch.dtype, torch.device]
Layout = Sequence[tuple[int, torch.Size]]  # (offset in the bucket, parameter shape)


@dataclass
class _Matrix:
    """One compressed gradient: ``numel`` entries from ``offset``, seen as rows × cols."""

    offset: int
    numel: int
    rows: int
    cols: int
    rank: int
    q: torch.Tensor | None = None  # cols × rank

    @property
    def padded(self) -> bool:
        return self.rows * self.cols != self.numel


@dataclass
class _BucketState:
    """Per bucket: its matrices, the uncompressed ranges, the residual and a call count."""

    matrices: list[_Matrix]
    dense: list[tuple[int, int]]  # (offset, numel) sent uncompressed
    error: torch.Tensor | None = None  # bucket-sized residual, compute dtype
    steps: int = 0
    pads: dict[int, torch.Tensor] = field(default_factory=dict)  # work buffers of padded ones


def matrix_shape(numel: int) -> tuple[int, int]:
    """``(rows, cols)`` of the padded matrix a flat bucket of ``numel`` elements is viewed as."""
    rows = max(1, math.ceil(math.sqrt(numel)))
    return rows, max(1, math.ceil(numel / rows))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=_compute_dtype(dtype)).element_size()


def orthonormalise(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``x`` (rows × r), in place where possible."""
    if x.shape[1] == 1:
        norm = torch.linalg.vector_norm(x)
        return x.div_(norm.clamp_min(torch.finfo(x.dtype).tiny))  # a zero column stays zero
    return torch.linalg.qr(x, mode="reduced").Q


class PowerSGD:
    """Blocking in-place PowerSGD allreduce of one bucket; run on a worker by the wrapper."""

    def __init__(self, inner: AllreduceFn, group: dist.ProcessGroup, config: Mapping[str, Any]):
        cfg = check_config("powersgd", config, DEFAULTS)
        for key in ("rank", "start_step", "min_compression_bytes", "seed"):
            value = cfg[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"powersgd config {key!r} must be an int >= 0, got {value!r}")
        if cfg["rank"] < 1:
            raise ValueError(f"powersgd config 'rank' must be >= 1, got {cfg['rank']}")
        for key in ("warm_start", "error_feedback"):
            if not isinstance(cfg[key], bool):
                raise ValueError(f"powersgd config {key!r} must be a bool, got {cfg[key]!r}")
        self.inner = inner
        self.world_size = group.size()
        self.rank: int = cfg["rank"]
        self.start_step: int = cfg["start_step"]
        self.warm_start: bool = cfg["warm_start"]
        self.error_feedback: bool = cfg["error_feedback"]
        self.min_compression_bytes: int = cfg["min_compression_bytes"]
        self.stats = CompressorStats()
        self._generator = torch.Generator().manual_seed(cfg["seed"])
        self._layouts: dict[_Key, Layout] = {}
        self._states: dict[_Key, _BucketState] = {}

    # -- policy -------------------------------------------------------------------------------

    def set_layout(self, bucket: torch.Tensor, layout: Layout) -> None:
        """Compress ``bucket`` per parameter: ``layout`` lists each one's (offset, shape)."""
        self._layouts[self._key(bucket)] = list(layout)

    def reset(self) -> None:
        """Forget every bucket's layout and state: the buckets were rebuilt (a DDP hook's)."""
        self._layouts.clear()
        self._states.clear()

    def _plan(self, tensor: torch.Tensor) -> _BucketState:
        layout = self._layouts.get(self._key(tensor))
        if layout is None:  # one padded matrix for the whole flat bucket
            rows, cols = matrix_shape(tensor.numel())
            return _BucketState(
                [_Matrix(0, tensor.numel(), rows, cols, min(self.rank, rows, cols))], []
            )
        matrices, dense = [], []
        for offset, shape in layout:
            numel = math.prod(shape)
            rows = shape[0] if len(shape) >= 2 else 1
            cols = numel // max(rows, 1)
            r = min(self.rank, rows, cols)
            if len(shape) >= 2 and (rows + cols) * r < numel:
                matrices.append(_Matrix(offset, numel, rows, cols, r))
            else:
                dense.append((offset, numel))
        covered = sum(m.numel for m in matrices) + sum(n for _, n in dense)
        if covered < tensor.numel():  # trailing slots (e.g. flags): sent as they are
            dense.append((covered, tensor.numel() - covered))
        return _BucketState(matrices, dense)

    def _state(self, tensor: torch.Tensor) -> _BucketState:
        key = self._key(tensor)
        state = self._states.get(key)
        if state is None:
            state = self._states[key] = self._plan(tensor)
        return state

    def compressed_bytes(self, numel: int, dtype: torch.dtype) -> int:
        """Bytes a compressed step of a flat ``numel``-element bucket sends (no layout)."""
        rows, cols = matrix_shape(numel)
        r = min(self.rank, rows, cols)
        return self._bytes(0, rows * r, cols * r, dtype)

    def _bytes(self, dense: int, p: int, q: int, dtype: torch.dtype) -> int:
        size = _itemsize(dtype)
        return ring_bytes((dense + p) * size, self.world_size) + ring_bytes(
            q * size, self.world_size
        )

    def _state_bytes(self, state: _BucketState, dtype: torch.dtype) -> int:
        dense = sum(n for _, n in state.dense)
        p = sum(m.rows * m.rank for m in state.matrices)
        q = sum(m.cols * m.rank for m in state.matrices)
        return self._bytes(dense, p, q, dtype)

    def compressible(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a float bucket large enough for compression to save bytes."""
        if not tensor.is_floating_point() or self.world_size == 1:
            return False
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0 or nbytes < self.min_compression_bytes:
            return False
        state = self._state(tensor)
        return bool(state.matrices) and self._state_bytes(state, tensor.dtype) < ring_bytes(
            nbytes, self.world_size
        )

    def residual(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """A copy of this rank's residual for bucket ``tensor`` (None before compression)."""
        state = self._states.get(self._key(tensor))
        return None if state is None or state.error is None else state.error.clone()

    # -- one call -----------------------------------------------------------------------------

    def __call__(self, tensor: torch.Tensor) -> None:
        state = self._state(tensor) if self.compressible(tensor) else None
        if state is not None:
            state.steps += 1
        if state is None or state.steps <= self.start_step:
            self.stats.record(
                ring_bytes(tensor.numel() * tensor.element_size(), self.world_size), False
            )
            wait_for(self.inner(tensor))
            return
        self.stats.record(self._state_bytes(state, tensor.dtype), True)
        flat = tensor.detach().reshape(-1)  # a view for contiguous buckets
        self._compress(flat, state)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view(tensor.shape))

    @staticmethod
    def _key(tensor: torch.Tensor) -> _Key:
        return (tensor.data_ptr(), tensor.numel(), tensor.dtype, tensor.device)

    def _matrix(self, work: torch.Tensor, m: _Matrix, state: _BucketState) -> torch.Tensor:
        """``m``'s entries of ``work`` as a rows × cols matrix (a zero-padded copy if needed)."""
        entries = work[m.offset : m.offset + m.numel]
        if not m.padded:
            return entries.view(m.rows, m.cols)
        pad = state.pads.get(m.offset)
        if pad is None:
            pad = state.pads[m.offset] = work.new_zeros(m.rows * m.cols)
        pad[: m.numel].copy_(entries)
        pad[m.numel :].zero_()
        return pad.view(m.rows, m.cols)

    def _compress(self, flat: torch.Tensor, state: _BucketState) -> None:
        work = flat.to(_compute_dtype(flat.dtype), copy=True)  # M = grad (+ residual)
        if self.error_feedback:
            if state.error is None:
                state.error = torch.zeros_like(work)
            else:
                work.add_(state.error)
        mats = [self._matrix(work, m, state) for m in state.matrices]
        starts: list[torch.Tensor] = []  # each matrix's Q: the last step's (warm start) or new
        for m, mat in zip(state.matrices, mats, strict=True):
            if m.q is None or not self.warm_start:
                q = torch.randn(m.cols, m.rank, generator=self._generator, dtype=mat.dtype)
                if mat.device.type == "cuda":  # from pinned memory: a copy that does not stall
                    q = q.pin_memory()
                m.q = q.to(mat.device, non_blocking=True)
            starts.append(m.q)
        dense = [work[o : o + n] for o, n in state.dense]
        ps = [torch.matmul(mat, orthonormalise(q)) for q, mat in zip(starts, mats, strict=True)]
        first = torch.cat([*dense, *(p.reshape(-1) for p in ps)])
        wait_for(self.inner(first))  # the uncompressed entries and every P, in one allreduce
        at = 0
        for d in dense:
            d.copy_(first[at : at + d.numel()])
            at += d.numel()
        qs = []
        for p, mat in zip(ps, mats, strict=True):
            p_sum = orthonormalise(first[at : at + p.numel()].view_as(p))
            at += p.numel()
            qs.append((p_sum, torch.matmul(mat.t(), p_sum)))
        second = torch.cat([q.reshape(-1) for _, q in qs])
        wait_for(self.inner(second))
        at = 0
        for m, (p_hat, q) in zip(state.matrices, qs, strict=True):
            m.q = second[at : at + q.numel()].view_as(q).clone()
            at += q.numel()
            approx = torch.matmul(p_hat, m.q.t()).reshape(-1)[: m.numel]
            if self.error_feedback:
                assert state.error is not None
                error = state.error[m.offset : m.offset + m.numel]
                error.copy_(work[m.offset : m.offset + m.numel]).sub_(
                    approx, alpha=1 / self.world_size
                )
            work[m.offset : m.offset + m.numel].copy_(approx)
        if self.error_feedback:
            assert state.error is not None
            for o, n in state.dense:
                state.error[o : o + n].zero_()  # sent exactly: nothing left over
        flat.copy_(work)


def cost(bucket: Bucket) -> Wire:
    """Steady state (after ``start_step``): per matrix gradient whose rank-r factors are smaller,
    ``rows·r`` then ``cols·r`` float32 entries in two allreduces (the other gradients ride in
    the first), ``4·rows·cols·r`` FLOPs and three passes over the bucket for error feedback;
    buckets below ``min_compression_bytes`` go as they are. Kept per rank: the error-feedback
    buffer (the bucket) and the ``Q`` factors."""
    nbytes = bucket.nbytes
    if nbytes < int(bucket.config.get("min_compression_bytes", DEFAULTS["min_compression_bytes"])):
        return Wire((nbytes,))
    r = int(bucket.config.get("rank", DEFAULTS["rank"]))
    first, second, flops = bucket.extra_bytes / 4, 0.0, 0.0
    for g in bucket.grads:
        rows = g.shape[0] if len(g.shape) >= 2 else 1
        cols = g.numel // max(rows, 1)
        k = min(r, rows, cols)
        if len(g.shape) >= 2 and (rows + cols) * k < g.numel:
            first += rows * k
            second += cols * k
            flops += 4 * rows * cols * k
        else:
            first += g.numel
    feedback = nbytes if bucket.config.get("error_feedback", DEFAULTS["error_feedback"]) else 0
    return Wire(
        (first * 4, second * 4), memory=3 * nbytes, flops=flops, state=feedback + second * 4
    )


@register_compressor(
    "powersgd", config=CONFIG, lossy=True, title="PowerSGD", state="error feedback", cost=cost
)
def make_powersgd(
    inner: AllreduceFn, group: dist.ProcessGroup, config: Mapping[str, Any]
) -> AllreduceFn:
    """PowerSGD over ``inner``; config keys and defaults in ``DEFAULTS``."""
    return ThreadedCompressor(PowerSGD(inner, group, config), "powersgd")
