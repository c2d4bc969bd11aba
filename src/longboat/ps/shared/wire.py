"""The parameter server's wire format: one explicit binary frame per request and reply.

    frame  = header | meta | entry*
    header = "<4sBBHIQ": magic b"LBPS", version, 0, 0, n_entries, meta_len
    meta   = UTF-8 JSON object (scalars, strings, lists: step, trainer, hyper-parameters)
    entry  = "<HBB": name_len, dtype code, ndim | name (UTF-8) | "<ndim q": shape | raw bytes

Tensors travel as their raw little-endian bytes (C order); nothing is pickled. ``decode``
checks every length against the frame before touching it, so a malformed or oversize frame
raises ``WireError`` and never allocates more than the frame it was given.
"""

from __future__ import annotations

import json
import math
import struct
import sys
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

MAGIC = b"LBPS"
VERSION = 1
MAX_ENTRIES = 1 << 16
MAX_META = 1 << 20
MAX_NAME = 1024
MAX_NDIM = 8
_HEADER = struct.Struct("<4sBBHIQ")
_ENTRY = struct.Struct("<HBB")

DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.int8,
    torch.bool,
)
_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("longboat.ps.shared.wire needs a little-endian machine")


class WireError(ValueError):
    """A frame that does not follow the format (truncated, oversize, unknown dtype, ...)."""


@dataclass
class Message:
    """What one frame carries: JSON-able ``meta`` and named tensors."""

    meta: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def _raw(t: torch.Tensor) -> memoryview:
    flat = t.detach().cpu().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def encode(msg: Message) -> bytes:
    """The frame for ``msg`` (one copy of every tensor's bytes)."""
    meta = json.dumps(msg.meta, separators=(",", ":"), allow_nan=True).encode()
    if len(meta) > MAX_META:
        raise WireError(f"meta is {len(meta)} bytes; the limit is {MAX_META}")
    if len(msg.tensors) > MAX_ENTRIES:
        raise WireError(f"{len(msg.tensors)} tensors in one frame; the limit is {MAX_ENTRIES}")
    parts: list[bytes | memoryview] = [
        _HEADER.pack(MAGIC, VERSION, 0, 0, len(msg.tensors), len(meta)),
        meta,
    ]
    for name, tensor in msg.tensors.items():
        code = _CODE.get(tensor.dtype)
        if code is None:
            raise WireError(
                f"tensor {name!r} has dtype {tensor.dtype}, which the wire cannot carry"
            )
        if tensor.dim() > MAX_NDIM:
            raise WireError(f"tensor {name!r} has {tensor.dim()} dims; the limit is {MAX_NDIM}")
        raw_name = name.encode()
        if len(raw_name) > MAX_NAME:
            raise WireError(f"tensor name {name[:40]!r}... is longer than {MAX_NAME} bytes")
        parts.append(_ENTRY.pack(len(raw_name), code, tensor.dim()))
        parts.append(raw_name)
        parts.append(struct.pack(f"<{tensor.dim()}q", *tensor.shape))
        parts.append(_raw(tensor))
    return b"".join(parts)


def decode(frame: bytes, max_bytes: int | None = None) -> Message:
    """Parse ``frame``; tensors are read-only views of it (clone before writing to them)."""
    if max_bytes is not None and len(frame) > max_bytes:
        raise WireError(f"frame of {len(frame)} bytes exceeds the limit of {max_bytes}")
    view = memoryview(frame)
    if len(view) < _HEADER.size:
        raise WireError(
            f"frame of {len(view)} bytes is shorter than the {_HEADER.size}-byte header"
        )
    magic, version, _, _, count, meta_len = _HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r}: not a longboat parameter-server frame")
    if version != VERSION:
        raise WireError(f"frame version {version}; this longboat speaks version {VERSION}")
    if count > MAX_ENTRIES or meta_len > MAX_META:
        raise WireError(f"frame declares {count} tensors and {meta_len} meta bytes: too many")
    pos = _HEADER.size
    meta_raw = _take(view, pos, meta_len, "meta")
    pos += meta_len
    try:
        meta = json.loads(bytes(meta_raw)) if meta_len else {}
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, huge numbers, deep nesting
        raise WireError(f"meta is not valid JSON: {type(exc).__name__}: {exc}") from None
    if not isinstance(meta, dict):
        raise WireError(f"meta must be a JSON object, got {type(meta).__name__}")
    tensors: dict[str, torch.Tensor] = {}
    for _ in range(count):
        name_len, code, ndim = _ENTRY.unpack_from(_take(view, pos, _ENTRY.size, "entry header"))
        pos += _ENTRY.size
        if code >= len(DTYPES) or ndim > MAX_NDIM or name_len > MAX_NAME:
            raise WireError(f"entry with dtype code {code}, {ndim} dims, {name_len}-byte name")
        try:
            name = bytes(_take(view, pos, name_len, "name")).decode()
        except UnicodeDecodeError:
            raise WireError("tensor name is not UTF-8") from None
        pos += name_len
        shape = struct.unpack_from(f"<{ndim}q", _take(view, pos, 8 * ndim, "shape"))
        pos += 8 * ndim
        if any(s < 0 for s in shape):
            raise WireError(f"tensor {name!r} has a negative dimension {shape}")
        dtype = DTYPES[code]
        nbytes = math.prod(shape) * dtype.itemsize
        data = _take(view, pos, nbytes, f"tensor {name!r}")
        pos += nbytes
        if name in tensors:
            raise WireError(f"tensor {name!r} appears twice in one frame")
        tensors[name] = _tensor(data, dtype, shape)
    if pos != len(view):
        raise WireError(f"{len(view) - pos} unexpected bytes after the last tensor")
    return Message(meta, tensors)


def _take(view: memoryview, pos: int, size: int, what: str) -> memoryview:
    if size < 0 or pos + size > len(view):
        raise WireError(
            f"frame truncated: {what} needs {size} bytes at offset {pos}, the frame has {len(view)}"
        )
    return view[pos : pos + size]


def _tensor(data: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    try:
        if len(data) == 0:
            return torch.empty(shape, dtype=dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we never write to it
            return torch.frombuffer(data, dtype=dtype).reshape(shape)
    except (RuntimeError, ValueError, OverflowError) as exc:  # e.g. sizes whose strides overflow
        raise WireError(f"tensor of shape {shape} cannot be built: {exc}") from None


_Item = TypeVar("_Item")


def chunks_by_bytes(sized: Iterable[tuple[_Item, int]], limit: int) -> Iterator[list[_Item]]:
    """The items of ``(item, nbytes)`` pairs in order, in lists of at most ``limit`` bytes (an
    item larger than ``limit`` travels alone): how messages are kept under the size bound."""
    chunk: list[_Item] = []
    size = 0
    for item, nbytes in sized:
        if chunk and size + nbytes > limit:
            yield chunk
            chunk, size = [], 0
        chunk.append(item)
        size += nbytes
    if chunk:
        yield chunk
