"""A server's shards of the sparse tables: row ``id`` of a table lives on server
``id % num_servers`` at local row ``id // num_servers`` and is updated per touched row by the
table's own optimizer (SGD, Adagrad or lazy Adam)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from longboat.ps import optim
from longboat.ps.request import RequestError, meta_int
from longboat.ps.sparse import initial_rows


@dataclass
class Table:
    weight: torch.Tensor  # this server's rows: local row r is global id r * num_servers + index
    optimizer: str
    hparams: dict[str, Any]
    sync: bool
    state: dict[str, torch.Tensor]
    spec: dict[str, Any]
    version: int = 0
    pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
           "bfloat16": torch.bfloat16}  # fmt: skip


def make_table(
    name: str, spec: dict[str, Any], sync: bool, index: int, num_servers: int, max_bytes: int
) -> Table:
    """Server ``index``'s shard of the table ``spec`` describes (checked; at most ``max_bytes``
    for its rows and optimizer state)."""
    rows, dim = meta_int(spec, "rows", 0), meta_int(spec, "dim", 0)
    dtype_name = spec.get("dtype", "float32")
    dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if rows < 1 or dim < 1 or dtype is None:
        raise RequestError(f"table {name!r}: need rows >= 1, dim >= 1 and a float dtype")
    local = len(range(index, rows, num_servers))
    opt_name = spec.get("optimizer")
    if not isinstance(opt_name, str):
        raise RequestError(f"table {name!r}: 'optimizer' must be a string, got {opt_name!r}")
    states = len(optim.ROW_STATES.get(opt_name, ())) + 1
    if local * dim * dtype.itemsize * states > max_bytes:
        raise RequestError(f"table {name!r} needs more than {max_bytes} bytes here")
    seed, scale = meta_int(spec, "seed", 0), spec.get("scale", 0.01)
    if not 0 <= seed < 1 << 63:
        raise RequestError(f"table {name!r}: 'seed' must be in [0, 2**63), got {seed}")
    if not isinstance(scale, int | float) or not math.isfinite(scale):
        raise RequestError(f"table {name!r}: 'scale' must be a finite number, got {scale!r}")
    try:
        h = optim.check_hparams(opt_name, spec.get("hparams") or {})
        state = optim.row_state(opt_name, h, (local, dim), dtype)
    except (ValueError, TypeError) as exc:
        raise RequestError(f"table {name!r}: {exc}") from None
    ids = torch.arange(index, rows, num_servers)
    weight = initial_rows(ids, dim, seed, float(scale), dtype)
    return Table(weight, opt_name, h, sync, state, dict(spec))


def local_rows(
    name: str, table: Table, ids: torch.Tensor, index: int, num_servers: int
) -> torch.Tensor:
    """The local rows of global ``ids`` (all of them on server ``index``'s shard)."""
    if ids.numel() and (
        bool((ids % num_servers != index).any())
        or int(ids.min()) < 0
        or int(ids.max()) >= table.spec["rows"]
    ):
        raise RequestError(f"table {name!r}: ids outside server {index}'s shard")
    return ids // num_servers


def apply_rows(table: Table, rows: torch.Tensor, grad: torch.Tensor, divisor: int) -> None:
    """Merge duplicate ``rows`` (sum, then / ``divisor``) and apply the table's optimizer."""
    unique, inverse = torch.unique(rows, return_inverse=True)
    merged = torch.zeros(len(unique), grad.shape[1], dtype=grad.dtype)
    merged.index_add_(0, inverse, grad)
    if divisor != 1:
        merged /= divisor
    table.version += 1
    if len(unique):
        optim.apply_rows(
            table.optimizer,
            table.weight,
            table.state,
            unique,
            merged,
            table.hparams,
            table.version,
        )


def table_state(table: Table) -> dict[str, Any]:
    """``table`` for a checkpoint (tensors, numbers, strings: weights_only-safe)."""
    return {
        "weight": table.weight.clone(),
        "version": table.version,
        "spec": json.dumps(table.spec),
        "sync": table.sync,
        "state": {k: v.clone() for k, v in table.state.items()},
    }


def load_table(saved: dict[str, Any]) -> Table:
    """The table a ``table_state`` describes."""
    spec = json.loads(saved["spec"])
    h = optim.check_hparams(spec["optimizer"], spec.get("hparams") or {})
    return Table(
        saved["weight"].clone(),
        spec["optimizer"],
        h,
        bool(saved["sync"]),
        {k: v.clone() for k, v in saved["state"].items()},
        spec,
        version=int(saved["version"]),
    )
