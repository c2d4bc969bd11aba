"""Synthetic Criteo-shaped click-through-rate data: categorical slots with Zipf-distributed ids,
dense features, and clicks drawn from a hidden logistic model (so a model's loss can fall).

Ids: slot ``s`` owns the disjoint range ``[offsets[s], offsets[s] + vocab[s])`` of one global id
space of ``total_rows`` ids, so one table of ``total_rows`` rows (or one table per slot, after
subtracting the offsets) holds every slot. Within a slot, popularity rank ``k`` (0 = most
frequent) has probability ``P(k) = F(k + 2) - F(k + 1)``, ``F`` the CDF of the density
``∝ x ** -zipf`` on ``[1, vocab + 1]`` (a discretised bounded Zipf law, ``P(k) ≈ (k + 1) **
-zipf`` normalised; sampled by inverting ``F`` in closed form: no per-id table). Ranks are scattered over the slot's range by a fixed bijection
``k -> (k * a + c) mod vocab``, as hashed Criteo ids are.

Samples are a pure function of (seed, global sample index): sample ``i`` of step ``t`` has index
``t * global_batch + i`` and every random draw is a counter-based hash (splitmix64) of that
index and the field. Trainer ``r`` of ``n`` draws samples ``[r * B // n, (r + 1) * B // n)`` of
every global batch, so the trainers' batches, concatenated in trainer order, are exactly the
single-process global batch. Dense features are standard normal (think log-scaled, normalised
counts). Labels: ``click ~ Bernoulli(sigmoid(bias + dense @ w +
id_scale * sum_s u(id_s)))`` with ``u(id)`` uniform in [-1, 1], a hash of (seed, id).

    data = CTRData(CTRConfig(), global_batch=4096, trainer=0, trainers=2)
    for step, batch in zip(range(100), data):
        batch.dense, batch.ids, batch.labels  # [2048, 13] float32, [2048, 26] int64, [2048]
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

# Cardinalities of the 26 categorical features of the Criteo Kaggle display-ads data set.
CRITEO_VOCAB: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
    14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB
_FIELD_ID, _FIELD_DENSE, _FIELD_LABEL = 0, 1, 2


def criteo_vocab(max_rows: int | None = None) -> tuple[int, ...]:
    """Criteo's 26 slot cardinalities, each capped at ``max_rows`` (as DLRM's
    ``--max-ind-range`` hashes the large ones): 10**6 gives 5.57 M rows in all."""
    return tuple(CRITEO_VOCAB if max_rows is None else (min(v, max_rows) for v in CRITEO_VOCAB))


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (wrap-around multiply, logical shifts)."""
    x = (x ^ ((x >> 30) & ((1 << 34) - 1))) * _MIX1
    x = (x ^ ((x >> 27) & ((1 << 37) - 1))) * _MIX2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def _unit(bits: torch.Tensor) -> torch.Tensor:
    """Uniform float64 in [0, 1) from the top 53 bits."""
    return ((bits >> 11) & ((1 << 53) - 1)).to(torch.float64) * (1.0 / (1 << 53))


@dataclass(frozen=True)
class CTRConfig:
    """The data set: slot cardinalities, dense width, Zipf exponent, hidden model, seed."""

    vocab: tuple[int, ...] = field(default_factory=lambda: criteo_vocab(100_000))
    num_dense: int = 13
    zipf: float = 1.05
    id_scale: float = 0.5  # weight of each slot's hidden per-id effect in the logit
    bias: float = -1.0  # hidden logit bias (about 35 % clicks with the other defaults)
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < len(self.vocab) <= 1024 or min(self.vocab) < 1 or self.zipf <= 0:
            raise ValueError("CTRConfig: need 1-1024 slots, vocab >= 1 per slot, zipf > 0")
        if not 0 <= self.num_dense <= 1024:
            raise ValueError("CTRConfig: need 0 <= num_dense <= 1024")

    @property
    def num_slots(self) -> int:
        return len(self.vocab)

    @property
    def offsets(self) -> torch.Tensor:
        """First global id of every slot, int64 [num_slots]."""
        v = torch.tensor(self.vocab, dtype=torch.int64)
        return torch.cumsum(v, 0) - v

    @property
    def total_rows(self) -> int:
        return sum(self.vocab)


class CTRBatch(NamedTuple):
    dense: torch.Tensor  # float32 [b, num_dense]
    ids: torch.Tensor  # int64 [b, num_slots], global ids in [0, total_rows)
    labels: torch.Tensor  # float32 [b], 0 or 1


class CTRData:
    """Trainer ``trainer``'s part of every global batch of ``global_batch`` samples; iterate
    for steps 0, 1, 2, ... or call ``batch(step)``."""

    def __init__(
        self, config: CTRConfig, global_batch: int, trainer: int = 0, trainers: int = 1
    ) -> None:
        if not 0 <= trainer < trainers or global_batch < trainers:
            raise ValueError(f"need 0 <= trainer < trainers <= global_batch, got "
                             f"{trainer}, {trainers}, {global_batch}")  # fmt: skip
        self.config, self.global_batch = config, global_batch
        self.lo, self.hi = (
            trainer * global_batch // trainers,
            (trainer + 1) * global_batch // trainers,
        )
        c = config
        self._key = int(_mix(torch.tensor([c.seed * 0x2545F491 + 1], dtype=torch.int64))[0])
        self._vocab = torch.tensor(c.vocab, dtype=torch.float64)
        self._vocab_i = torch.tensor(c.vocab, dtype=torch.int64)
        self._offsets = c.offsets
        self._mult, self._add = self._scatter(c.vocab, self._key)
        self._top = (self._vocab + 1) ** (1 - c.zipf) if c.zipf != 1 else torch.log(self._vocab + 1)
        g = torch.Generator().manual_seed(c.seed)
        self.dense_weight = torch.randn(c.num_dense, generator=g, dtype=torch.float64)
        self.dense_weight /= max(1.0, math.sqrt(c.num_dense) / 1.5)  # dense logit std ~1.5

    @staticmethod
    def _scatter(vocab: tuple[int, ...], key: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per slot, ``a`` coprime to the slot's vocab and ``c``: rank k -> (k a + c) mod v."""
        mult, add = [], []
        for s, v in enumerate(vocab):
            h = int(_mix(torch.tensor([key ^ (s * 7919 + 13)], dtype=torch.int64))[0]) & (2**62 - 1)
            a = h % v or 1
            while math.gcd(a, v) != 1:
                a = a % v + 1
            mult.append(a)
            add.append((h >> 20) % v)
        return torch.tensor(mult, dtype=torch.int64), torch.tensor(add, dtype=torch.int64)

    def _bits(self, index: torch.Tensor, kind: int, width: int) -> torch.Tensor:
        """Hash bits [len(index), width] of (seed, sample index, kind, column)."""
        cell = (index.unsqueeze(1) * 1024 + torch.arange(width, dtype=torch.int64)) * 4 + kind
        return _mix(cell * _GOLDEN + self._key)

    def hidden_id_effect(self, ids: torch.Tensor) -> torch.Tensor:
        """``u(id)``: each global id's hidden effect on the logit, uniform in [-1, 1)."""
        return _unit(_mix((ids * 4 + 3) * _GOLDEN + self._key)) * 2 - 1

    def samples(self, start: int, count: int) -> CTRBatch:
        """Samples ``start .. start + count - 1`` of the global stream."""
        c = self.config
        index = torch.arange(start, start + count, dtype=torch.int64)
        u = _unit(self._bits(index, _FIELD_ID, c.num_slots))
        a = c.zipf
        x = torch.exp(u * self._top) if a == 1 else (1 + u * (self._top - 1)) ** (1 / (1 - a))
        rank = torch.minimum(x.floor().to(torch.int64) - 1, self._vocab_i - 1).clamp_(min=0)
        ids = (rank * self._mult + self._add) % self._vocab_i + self._offsets
        pairs = (c.num_dense + 1) // 2
        ud = _unit(self._bits(index, _FIELD_DENSE, 2 * pairs))
        radius = torch.sqrt(-2 * torch.log1p(-ud[:, :pairs]))
        angle = 2 * math.pi * ud[:, pairs:]
        dense = torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)], 1)
        dense = dense[:, : c.num_dense]
        logit = c.bias + dense @ self.dense_weight
        logit += c.id_scale * self.hidden_id_effect(ids).sum(1)
        click = _unit(self._bits(index, _FIELD_LABEL, 1)[:, 0]) < torch.sigmoid(logit)
        return CTRBatch(dense.to(torch.float32), ids, click.to(torch.float32))

    def batch(self, step: int) -> CTRBatch:
        """This trainer's part of global batch ``step``."""
        return self.samples(step * self.global_batch + self.lo, self.hi - self.lo)

    def __iter__(self) -> Iterator[CTRBatch]:
        step = 0
        while True:
            yield self.batch(step)
            step += 1
