"""``SparseEmbedding``: an embedding table that lives on the parameter servers, sharded by row id.

Row ``i`` lives on server ``i % num_servers`` at local row ``i // num_servers``. A trainer
pulls only the rows its batch uses (duplicates merged), and backward produces row-sparse
gradients that the engine pushes; the servers update each touched row with the table's own
optimizer (SGD, Adagrad or lazy Adam). Initial values depend only on (seed, row id), never on
the number of servers, so ``initial_weight()`` rebuilds the whole table for a reference run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from longboat.ps.optim import ROW_STATES

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB


def _splitmix(x: torch.Tensor) -> torch.Tensor:
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
    bits = _splitmix(_splitmix(cells) ^ seed)
    unit = ((bits >> 11) & ((1 << 53) - 1)).to(torch.float64) / float(1 << 53)
    return ((unit * 2 - 1) * scale).to(dtype)


class SparseEmbedding(nn.Module):
    """An embedding table held by the parameter servers (use it inside a model given to
    ``lb.distribute`` with ``Strategy(mode="ps")``).

    ``optimizer`` is "sgd", "adagrad" or "adam" with ``hparams`` (``lr`` and the optimizer's
    own keys, see ``longboat.ps.optim.HPARAMS``); it runs on the servers, per touched row.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        name: str,
        *,
        optimizer: str = "sgd",
        lr: float = 0.01,
        seed: int = 0,
        init_scale: float | None = None,
        dtype: torch.dtype = torch.float32,
        **hparams: Any,
    ) -> None:
        super().__init__()
        if optimizer not in ROW_STATES:
            raise ValueError(
                f"SparseEmbedding {name!r}: optimizer must be one of "
                f"{sorted(ROW_STATES)}, got {optimizer!r}"
            )
        if num_embeddings < 1 or embedding_dim < 1:
            raise ValueError(f"SparseEmbedding {name!r}: sizes must be >= 1")
        self.num_embeddings, self.embedding_dim, self.name = num_embeddings, embedding_dim, name
        self.optimizer, self.hparams = optimizer, {"lr": lr, **hparams}
        self.seed, self.dtype = seed, dtype
        self.init_scale = init_scale if init_scale is not None else embedding_dim**-0.5
        self._lookup: Callable[[SparseEmbedding, torch.Tensor], torch.Tensor] | None = None

    def spec(self) -> dict[str, Any]:
        """What the servers need to create their shard of this table (JSON-able)."""
        return {
            "name": self.name,
            "rows": self.num_embeddings,
            "dim": self.embedding_dim,
            "dtype": str(self.dtype).removeprefix("torch."),
            "optimizer": self.optimizer,
            "hparams": self.hparams,
            "seed": self.seed,
            "scale": self.init_scale,
        }

    def initial_weight(self) -> torch.Tensor:
        """The full initial table (for single-process references; allocates it all)."""
        ids = torch.arange(self.num_embeddings)
        return initial_rows(ids, self.embedding_dim, self.seed, self.init_scale, self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self._lookup is None:
            raise RuntimeError(
                f"SparseEmbedding {self.name!r} has no servers: pass the model to lb.distribute "
                "with Strategy(mode='ps') first (for local training build nn.Embedding from "
                "initial_weight())"
            )
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise IndexError(
                f"SparseEmbedding {self.name!r}: ids must be in [0, {self.num_embeddings}), "
                f"got min {int(ids.min())} max {int(ids.max())}"
            )
        return self._lookup(self, ids)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, name={self.name!r}, "
            f"optimizer={self.optimizer!r}"
        )
