"""The binary frame: exact round trips, and refusal of every malformed frame."""

from __future__ import annotations

import struct

import pytest
import torch

from longboat.ps.shared import wire
from longboat.ps.shared.wire import Message, WireError


def test_round_trip_keeps_dtype_shape_bytes_and_meta() -> None:
    tensors = {
        "f32": torch.randn(3, 4),
        "f64": torch.randn(2, dtype=torch.float64),
        "bf16": torch.randn(5).to(torch.bfloat16),
        "i64": torch.tensor([1, -2, 1 << 40]),
        "bool": torch.tensor([True, False]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 7),
        "strided": torch.randn(4, 6)[:, ::2],  # non-contiguous: sent in C order
    }
    meta = {"step": 3, "keys": ["a", "b"], "lr": 0.1}
    got = wire.decode(wire.encode(Message(meta, tensors)))
    assert got.meta == meta and list(got.tensors) == list(tensors)
    for name, t in tensors.items():
        assert got.tensors[name].dtype == t.dtype and got.tensors[name].shape == t.shape
        assert torch.equal(got.tensors[name], t), name


GOOD = wire.encode(Message({"a": 1}, {"x": torch.ones(2, 2)}))


@pytest.mark.parametrize(
    ("frame", "match"),
    [
        (b"", "shorter than"),
        (b"NOPE" + GOOD[4:], "bad magic"),
        (GOOD[:-1], "truncated"),
        (GOOD + b"x", "unexpected bytes"),
        (GOOD[:4] + bytes([9]) + GOOD[5:], "version 9"),
        (wire._HEADER.pack(wire.MAGIC, 1, 0, 0, 0, 3) + b"[1]", "JSON object"),
        (wire._HEADER.pack(wire.MAGIC, 1, 0, 0, 0, 2) + b"{x", "not valid JSON"),
        (wire._HEADER.pack(wire.MAGIC, 1, 0, 0, 1 << 30, 0), "too many"),
        # one entry announcing a 2**40-element tensor in a 40-byte frame
        (
            wire._HEADER.pack(wire.MAGIC, 1, 0, 0, 1, 0)
            + struct.pack("<HBB", 1, 0, 2)
            + b"x"
            + struct.pack("<2q", 1 << 20, 1 << 20),
            "truncated",
        ),  # fmt: skip
        (
            wire._HEADER.pack(wire.MAGIC, 1, 0, 0, 1, 0) + struct.pack("<HBB", 1, 77, 0) + b"x",
            "dtype code 77",
        ),  # fmt: skip
        (
            wire._HEADER.pack(wire.MAGIC, 1, 0, 0, 1, 0)
            + struct.pack("<HBB", 1, 0, 1)
            + b"x"
            + struct.pack("<q", -4),
            "negative",
        ),  # fmt: skip
    ],
)
def test_malformed_frames_are_refused(frame: bytes, match: str) -> None:
    with pytest.raises(WireError, match=match):
        wire.decode(frame)


def test_size_limit_is_checked_first() -> None:
    with pytest.raises(WireError, match="exceeds the limit of 10"):
        wire.decode(GOOD, max_bytes=10)


def test_unsupported_dtype_is_named() -> None:
    with pytest.raises(WireError, match="complex64"):
        wire.encode(Message({}, {"c": torch.zeros(2, dtype=torch.complex64)}))
