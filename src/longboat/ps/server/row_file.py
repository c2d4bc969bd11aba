"""A chunked file of table rows: written and read a chunk at a time, never whole in memory.

Layout: ``MAGIC``, the header's length (8 bytes, little-endian), a JSON header (row count,
rows per chunk, each column's name, dtype and row shape), then the chunks in order, each with
every column's rows as raw little-endian bytes. Written to a temporary file, fsynced and renamed
(a crash leaves the old file or the new one). Reading checks the header against the columns the
caller expects and the file's size against the header before allocating anything; no object is
ever unpickled.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

MAGIC = b"LBROWS1\0"
CHUNK_BYTES = 1 << 20  # bytes of one column per chunk (at most)
_MAX_HEADER = 1 << 16
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.int32, torch.int64, torch.float16,
           torch.bfloat16, torch.float32, torch.float64)}  # fmt: skip

Columns = dict[str, torch.Tensor]
Like = dict[str, tuple[torch.dtype, tuple[int, ...]]]


def _row_bytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return dtype.itemsize * math.prod(shape)


def write(path: str | Path, rows: int, columns: Columns) -> None:
    """Write the first ``rows`` rows of each of ``columns`` (tensors of at least that many
    rows) to ``path``."""
    path = Path(path)
    widest = max(_row_bytes(t.dtype, tuple(t.shape[1:])) for t in columns.values())
    chunk = max(1, CHUNK_BYTES // widest)
    header = {
        "rows": rows,
        "chunk_rows": chunk,
        "columns": [
            [k, str(t.dtype).removeprefix("torch."), list(t.shape[1:])] for k, t in columns.items()
        ],
    }
    head = json.dumps(header).encode()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(MAGIC + len(head).to_bytes(8, "little") + head)
        for start in range(0, rows, chunk):
            for t in columns.values():
                part = t[start : min(start + chunk, rows)].contiguous()
                f.write(memoryview(part.view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read(path: str | Path, like: Like) -> tuple[int, Columns]:
    """(row count, columns) of the file at ``path``, whose columns must be exactly ``like``
    (name -> (dtype, row shape)); read a chunk at a time into the final tensors."""
    path = Path(path)
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise ValueError(f"{path} is not a table row file")
        size = int.from_bytes(f.read(8), "little")
        if not 0 < size <= _MAX_HEADER:
            raise ValueError(f"{path}: header of {size} bytes")
        header = json.loads(f.read(size))
        rows, chunk = int(header["rows"]), int(header["chunk_rows"])
        found = {c[0]: (_DTYPES.get(c[1]), tuple(int(d) for d in c[2])) for c in header["columns"]}
        if found != like or rows < 0 or chunk < 1:
            raise ValueError(f"{path}: columns {found} do not match the table's {like}")
        body = sum(_row_bytes(d, s) for d, s in like.values()) * rows
        if os.fstat(f.fileno()).st_size != len(MAGIC) + 8 + size + body:
            raise ValueError(f"{path}: size does not match its header (truncated?)")
        names = [c[0] for c in header["columns"]]
        out = {k: torch.empty(rows, *like[k][1], dtype=like[k][0]) for k in names}
        for start in range(0, rows, chunk):
            for k in names:
                part = out[k][start : min(start + chunk, rows)]
                view = memoryview(part.view(torch.uint8).numpy()).cast("B")
                if f.readinto(view) != view.nbytes:
                    raise ValueError(f"{path}: ended early")
    return rows, out
