"""Row-sparse values (MXNet's ``RowSparseNDArray``): the listed rows of a tensor of ``shape``,
every other row zero.

    g = kvstore.row_sparse_array((rows, [0, 5]), shape=(10, 4))   # rows 0 and 5 of a 10x4
    kv.push("emb", g)                                              # summed per row across workers
    out = kvstore.RowSparse.zeros((10, 4))
    kv.row_sparse_pull("emb", out=out, row_ids=torch.tensor([5, 0, 5]))  # out.indices = [0, 5]

On servers the pull moves only the rows asked (``KVClient.pull_rows_many``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from longboat.kvstore.errors import InvalidArgumentError
from longboat.ps.trainer.kv import check_row_ids


@dataclass
class RowSparse:
    """``data[i]`` is row ``indices[i]`` of a ``shape`` tensor; ``indices`` sorted, unique."""

    data: torch.Tensor
    indices: torch.Tensor
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        self.shape = tuple(int(n) for n in self.shape)
        self.indices = torch.as_tensor(self.indices, dtype=torch.int64).reshape(-1)
        if not self.shape:
            raise ValueError("a row-sparse value needs at least one dimension (rows)")
        if tuple(self.data.shape) != (len(self.indices), *self.shape[1:]):
            raise ValueError(
                f"row-sparse data has shape {tuple(self.data.shape)}; {len(self.indices)} rows "
                f"of a {self.shape} value need {(len(self.indices), *self.shape[1:])}"
            )
        check_rows(self.indices, self.shape[0])
        if len(self.indices) > 1 and not bool((self.indices[1:] > self.indices[:-1]).all()):
            raise ValueError("row-sparse indices must be sorted and unique")

    @classmethod
    def zeros(cls, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> RowSparse:
        """No rows stored (MXNet's ``nd.sparse.zeros('row_sparse', shape)``)."""
        return cls(torch.zeros(0, *shape[1:], dtype=dtype), torch.zeros(0, dtype=torch.int64),
                   tuple(shape))  # fmt: skip

    @classmethod
    def from_dense(cls, value: torch.Tensor) -> RowSparse:
        """The rows of ``value`` that hold a non-zero (MXNet's ``tostype('row_sparse')``)."""
        rows = value.reshape(len(value), -1).ne(0).any(dim=1).nonzero().reshape(-1)
        return cls(value[rows].clone(), rows.cpu(), tuple(value.shape))

    @classmethod
    def from_sparse(cls, value: torch.Tensor) -> RowSparse:
        """The rows of a torch sparse tensor: a COO tensor with one sparse dimension (what
        ``nn.Embedding(sparse=True)`` gives its weight as gradient) keeps its rows, repeats
        summed; other sparse layouts keep the rows that hold a non-zero."""
        if value.layout == torch.sparse_coo and value.sparse_dim() == 1:
            rows = value.coalesce()
            return cls(rows.values(), rows.indices()[0].cpu(), tuple(value.shape))
        return cls.from_dense(value.to_dense())

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to_dense(self) -> torch.Tensor:
        """The full tensor (MXNet's ``tostype('default')``)."""
        out = torch.zeros(self.shape, dtype=self.data.dtype, device=self.data.device)
        out[self.indices.to(out.device)] = self.data
        return out

    def detach(self) -> RowSparse:
        return RowSparse(self.data.detach(), self.indices, self.shape)


def row_sparse_array(
    arg: tuple[torch.Tensor | Sequence[float], torch.Tensor | Sequence[int]],
    shape: Sequence[int],
    dtype: torch.dtype | None = None,
) -> RowSparse:
    """MXNet's ``nd.sparse.row_sparse_array((data, indices), shape=...)``."""
    data, indices = arg
    return RowSparse(torch.as_tensor(data, dtype=dtype), torch.as_tensor(indices), tuple(shape))


def check_rows(ids: torch.Tensor, num_rows: int, what: str = "") -> None:
    """Refuses row ids outside ``[0, num_rows)`` (``InvalidArgumentError`` naming one, after
    ``what``: e.g. the call and key)."""
    try:
        check_row_ids(ids, num_rows, what)
    except ValueError as exc:
        raise InvalidArgumentError(str(exc)) from None


__all__ = ["RowSparse", "check_rows", "row_sparse_array"]
