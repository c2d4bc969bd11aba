"""Initial values of sparse table rows: a pure function of (table seed, row id), never of the
number of servers, so a server creates a row and a trainer rebuilds the whole table
(``SparseEmbedding.initial_weight``) to the same values. ``splitmix`` also hashes ids for the
servers' row index and admission draws."""

from __future__ import annotations

import torch

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB


def splitmix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 on int64 tensors (wrap-around multiply; logical shifts via masks)."""
    x = x + _GOLDEN
    x = (x ^ ((x >> 30) & ((1 << 34) - 1))) * _MIX1
    x = (x ^ ((x >> 27) & ((1 << 37) - 1))) * _MIX2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def initial_rows(
    ids: torch.Tensor, dim: int, seed: int, scale: float, dtype: torch.dtype
) -> torch.Tensor:
    """Rows ``ids`` of the initial table: uniform in [-scale, scale), a pure function of the ids."""
    cells = ids.to(torch.int64).unsqueeze(1) * dim + torch.arange(dim, dtype=torch.int64)
    bits = splitmix(splitmix(cells) ^ seed)
    unit = ((bits >> 11) & ((1 << 53) - 1)).to(torch.float64) / float(1 << 53)
    return ((unit * 2 - 1) * scale).to(dtype)
