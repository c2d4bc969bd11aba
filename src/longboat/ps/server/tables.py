"""A server's shards of the sparse tables: row ``id`` of a table lives on server
``id % num_servers`` and is updated per touched row by the table's own optimizer (SGD, Adagrad
or lazy Adam). A preallocated table holds every row of its shard at local row
``id // num_servers``; a lazy table (spec ``"lazy": true``) creates rows on admission and may
evict, store half-precision rows and stream its checkpoints (``table_store.LazyRows``)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from longboat.log import get_logger
from longboat.ps.server.table_store import Admission, LazyRows
from longboat.ps.shared import optim
from longboat.ps.shared.request import RequestError, meta_int
from longboat.ps.shared.rows import initial_rows

log = get_logger("longboat.ps")


@dataclass
class Table:
    weight: torch.Tensor  # preallocated: local row r is global id r * num_servers + index;
    # lazy: no rows (0 x dim, the wire dtype), they live in ``lazy``
    optimizer: str
    hparams: dict[str, Any]
    sync: bool
    state: dict[str, torch.Tensor]
    spec: dict[str, Any]
    version: int = 0
    pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    lazy: LazyRows | None = None

    @property
    def dim(self) -> int:
        return self.weight.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of rows and gradients on the wire."""
        return self.weight.dtype


FLOAT_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
                "bfloat16": torch.bfloat16}  # fmt: skip


def make_table(
    name: str, spec: dict[str, Any], sync: bool, index: int, num_servers: int, max_bytes: int
) -> Table:
    """Server ``index``'s shard of the table ``spec`` describes (checked; at most ``max_bytes``
    for its rows and optimizer state)."""
    if spec.get("lazy"):
        return _make_lazy(name, spec, sync, num_servers, max_bytes)
    rows, dim = meta_int(spec, "rows", 0), meta_int(spec, "dim", 0)
    dtype = _dtype(spec, "dtype")
    if rows < 1 or dim < 1 or dtype is None:
        raise RequestError(f"table {name!r}: need rows >= 1, dim >= 1 and a float dtype")
    local = len(range(index, rows, num_servers))
    opt_name = spec.get("optimizer")
    if not isinstance(opt_name, str):
        raise RequestError(f"table {name!r}: 'optimizer' must be a string, got {opt_name!r}")
    states = len(optim.ROW_STATES.get(opt_name, ())) + 1
    if local * dim * dtype.itemsize * states > max_bytes:
        raise RequestError(
            f"table {name!r}: 'rows' {rows} x 'dim' {dim} need more than {max_bytes} bytes on "
            f"server {index} ({local} rows of its shard)"
        )
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


def _dtype(spec: dict[str, Any], key: str, default: str = "float32") -> torch.dtype | None:
    value = spec.get(key, default)
    return FLOAT_DTYPES.get(value) if isinstance(value, str) else None


def _make_lazy(
    name: str, spec: dict[str, Any], sync: bool, num_servers: int, max_bytes: int
) -> Table:
    """A lazy table's shard (see ``table_store``): spec keys ``rows`` (0: any int64 id),
    ``admission`` ({"count": n} or {"probability": p}), ``evict_after`` (passes; 0: never),
    ``storage`` (row dtype; default ``dtype``) and ``expected_rows`` (a capacity hint)."""
    rows, dim = meta_int(spec, "rows", 0), meta_int(spec, "dim", 0)
    dtype = _dtype(spec, "dtype")
    storage = _dtype(spec, "storage", spec.get("dtype", "float32"))
    opt_name = spec.get("optimizer")
    seed, scale = meta_int(spec, "seed", 0), spec.get("scale", 0.01)
    admission = spec.get("admission") or {}
    evict_after = meta_int(spec, "evict_after", 0)
    expected = meta_int(spec, "expected_rows", 0)
    count = meta_int(admission, "count", 1) if isinstance(admission, dict) else 0
    probability = admission.get("probability", 1.0) if isinstance(admission, dict) else None
    if (
        rows < 0 or dim < 1 or dtype is None or storage is None or not isinstance(opt_name, str)
        or _bad_lazy_numbers(seed, scale, count, evict_after, expected)
        or not isinstance(probability, int | float) or not 0 < probability <= 1
        or set(admission) - {"count", "probability"}
    ):  # fmt: skip
        raise RequestError(
            f"table {name!r}: a lazy table needs dim >= 1, float dtype/storage, an optimizer "
            "name, seed in [0, 2**63), a finite scale, admission {'count': n >= 1} or "
            "{'probability': 0 < p <= 1}, evict_after >= 0 and rows >= 0"
        )
    try:
        h = optim.check_hparams(opt_name, spec.get("hparams") or {})
    except (ValueError, TypeError) as exc:
        raise RequestError(f"table {name!r}: {exc}") from None
    per_server = -(-expected // num_servers)
    row_bytes = dim * (storage.itemsize + 4 * len(optim.ROW_STATES.get(opt_name, ()))) + 16
    if max(per_server, 16) * row_bytes > max_bytes:  # what LazyRows allocates at once
        raise RequestError(
            f"table {name!r}: 'expected_rows' {expected} of 'dim' {dim} need more than "
            f"{max_bytes} bytes on this server"
        )
    store = LazyRows(
        dim,
        storage,
        opt_name,
        h,
        key=seed,
        scale=float(scale),
        admission=Admission(count, float(probability), seed),
        evict_after=evict_after,
        expected_rows=per_server,
        max_bytes=max_bytes,
    )
    log.info(
        "table %r: lazy, %s rows of %d, %s; about %.0f bytes per row (float32 row: %d)",
        name,
        str(storage).removeprefix("torch."),
        dim,
        opt_name,
        store.row_bytes_estimate(),
        4 * dim,
    )
    return Table(torch.empty(0, dim, dtype=dtype), opt_name, h, sync, {}, dict(spec), lazy=store)


def _bad_lazy_numbers(seed: int, scale: Any, count: int, evict_after: int, expected: int) -> bool:
    """A lazy table's ``seed`` outside [0, 2**63), ``scale`` not a finite number, or an
    admission ``count``, ``evict_after`` or ``expected_rows`` out of range."""
    return (
        not 0 <= seed < 1 << 63 or not isinstance(scale, int | float)
        or not math.isfinite(scale) or count < 1 or evict_after < 0 or expected < 0
    )  # fmt: skip


def local_rows(
    name: str, table: Table, ids: torch.Tensor, index: int, num_servers: int
) -> torch.Tensor:
    """The local rows of global ``ids`` (all of them on server ``index``'s shard); a lazy
    table's rows are named by the global ids themselves."""
    rows = table.spec.get("rows") or 0
    if ids.numel() and (
        bool((ids % num_servers != index).any())
        or (rows > 0 and (int(ids.min()) < 0 or int(ids.max()) >= rows))
    ):
        raise RequestError(f"table {name!r}: ids outside server {index}'s shard")
    return ids if table.lazy is not None else ids // num_servers


def read_rows(table: Table, rows: torch.Tensor) -> torch.Tensor:
    """The values of local ``rows`` (as ``local_rows`` gives them), in the wire dtype."""
    if table.lazy is not None:
        return table.lazy.read(rows, table.dtype)
    return table.weight[rows]


def apply_rows(table: Table, rows: torch.Tensor, grad: torch.Tensor, divisor: int) -> None:
    """Merge duplicate ``rows`` (sum, then / ``divisor``) and apply the table's optimizer."""
    if len(rows) < 2 or bool((rows[1:] > rows[:-1]).all()):
        unique, merged = rows, grad  # already distinct and sorted (a trainer's torch.unique)
        if divisor != 1:
            merged = merged / divisor
    else:
        unique, inverse = torch.unique(rows, return_inverse=True)
        merged = torch.zeros(len(unique), grad.shape[1], dtype=grad.dtype)
        merged.index_add_(0, inverse, grad)
        if divisor != 1:
            merged /= divisor
    table.version += 1
    if table.lazy is not None:
        table.lazy.update(unique, merged, table.version)
    elif len(unique):
        optim.apply_rows(
            table.optimizer,
            table.weight,
            table.state,
            unique,
            merged,
            table.hparams,
            table.version,
        )


def table_state(table: Table, rows_file: Path | None = None) -> dict[str, Any]:
    """``table`` for a checkpoint (tensors, numbers, strings: weights_only-safe). A lazy
    table's rows go to ``rows_file`` in chunks when one is given, and its admission counters
    to ``counters_file(rows_file)``, else both into the dict; the checkpoint keeps the files'
    names only: they lie beside the checkpoint (``load_table`` looks for them in the
    checkpoint's directory, wherever that was moved)."""
    out = {
        "weight": table.weight.clone(),
        "version": table.version,
        "spec": json.dumps(table.spec),
        "sync": table.sync,
        "state": {k: v.clone() for k, v in table.state.items()},
    }
    if table.lazy is not None:
        out["lazy"] = table.lazy.extra_state(counters=rows_file is None)
        if rows_file is not None:
            table.lazy.save(rows_file)
            table.lazy.save_counters(counters_file(rows_file))
            out["rows_file"] = Path(rows_file).name
            out["counters_file"] = counters_file(rows_file).name
            stats = table.lazy.stats()
            log.info(
                "table %r saved: %d rows, %.1f bytes per row (float32 row: %d) to %s",
                table.spec.get("name"),
                stats["rows"],
                stats["bytes_per_row"],
                stats["float32_row_bytes"],
                rows_file,
            )
        else:
            out["lazy"]["rows"] = table.lazy.rows_dict()
    return out


def counters_file(rows_file: str | Path) -> Path:
    """Where a lazy table's admission counters go beside its ``rows_file``."""
    return Path(rows_file).with_suffix(".admission.rows")


def load_table(
    saved: dict[str, Any], directory: str | Path | None = None, max_bytes: int = 1 << 62
) -> Table:
    """The table a ``table_state`` describes; ``directory``: the checkpoint's (where a lazy
    table's row file lies; a path saved absolute by older versions is used as it is);
    ``max_bytes``: the most a lazy table's rows may take on this server, as when created."""
    spec = json.loads(saved["spec"])
    h = optim.check_hparams(spec["optimizer"], spec.get("hparams") or {})
    if "lazy" in saved:
        empty = {**spec, "expected_rows": 0}  # the rows come from the checkpoint
        table = _make_lazy(str(spec.get("name")), empty, bool(saved["sync"]), 1, max_bytes)
        table.spec = spec
        assert table.lazy is not None
        if "rows_file" in saved:
            table.lazy.load(Path(directory or ".") / saved["rows_file"])
        else:
            table.lazy.load_rows_dict(saved["lazy"]["rows"])
        table.lazy.load_extra_state(saved["lazy"])
        if "counters_file" in saved:
            table.lazy.load_counters(Path(directory or ".") / saved["counters_file"])
        table.version = int(saved["version"])
        return table
    return Table(
        saved["weight"].clone(),
        spec["optimizer"],
        h,
        bool(saved["sync"]),
        {k: v.clone() for k, v in saved["state"].items()},
        spec,
        version=int(saved["version"]),
    )
