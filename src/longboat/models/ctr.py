"""A small CTR model for ``longboat.data.ctr``: one embedding table for all slots + a dense
tower (a DLRM-like bottom MLP on the dense features, concatenated with the slots' embeddings,
then a top MLP to one logit).

Two variants with the same initial values: ``sparse=True`` holds the table in an
``lb.ps.SparseEmbedding`` (parameter-server mode: only the rows a batch uses travel), and
``sparse=False`` in an ``nn.Embedding`` (collective mode: its gradient is a dense
``rows x dim`` tensor, allreduced every step). The table starts from
``longboat.ps.shared.rows.initial_rows`` (a function of (seed, row id)), the tower from
``torch.manual_seed(seed)``. ``make_optimizer`` gives both variants the same Adagrad.
"""

from __future__ import annotations

import torch
from torch import nn

from longboat.data.ctr import CTRConfig
from longboat.ps.shared.rows import initial_rows
from longboat.ps.trainer.sparse import SparseEmbedding

TABLE = "ctr_ids"


def _mlp(widths: list[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class CTRModel(nn.Module):
    """``forward(dense [b, num_dense], ids [b, num_slots]) -> logits [b]``."""

    def __init__(
        self,
        config: CTRConfig,
        dim: int = 16,
        hidden: tuple[int, ...] = (64, 32),
        *,
        sparse: bool,
        emb_lr: float = 0.05,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.config, self.dim, self.sparse, self.emb_lr = config, dim, sparse, emb_lr
        rows = config.total_rows
        self.table: nn.Module
        if sparse:
            self.table = SparseEmbedding(rows, dim, TABLE, optimizer="adagrad", lr=emb_lr,
                                         seed=seed)  # fmt: skip
        else:
            self.table = nn.Embedding(rows, dim)
            with torch.no_grad():
                w, scale = self.table.weight, dim**-0.5  # SparseEmbedding's default scale
                for lo in range(0, rows, 1 << 20):  # in chunks: the hash needs int64 temporaries
                    ids = torch.arange(lo, min(rows, lo + (1 << 20)))
                    w[lo : lo + len(ids)] = initial_rows(ids, dim, seed, scale, w.dtype)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.bottom = _mlp([config.num_dense, 32, dim], last_relu=True)
            self.top = _mlp([(config.num_slots + 1) * dim, *hidden, 1], last_relu=False)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        emb = self.table(ids).flatten(1)  # [b, num_slots * dim]
        return self.top(torch.cat([self.bottom(dense), emb], 1)).squeeze(1)

    def tower_parameters(self) -> list[nn.Parameter]:
        return [*self.bottom.parameters(), *self.top.parameters()]


def make_optimizer(model: CTRModel, lr: float = 0.01) -> torch.optim.Adagrad:
    """Adagrad (lr ``lr``) on the tower; the table's rows get Adagrad with ``model.emb_lr``:
    on the servers (sparse variant) or as a second param group (dense variant, whose rows
    without gradient do not move, as on the servers)."""
    groups: list[dict] = [{"params": model.tower_parameters()}]
    if not model.sparse:
        groups.append({"params": list(model.table.parameters()), "lr": model.emb_lr})
    return torch.optim.Adagrad(groups, lr=lr)
