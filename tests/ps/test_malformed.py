"""Every malformed request is refused whole: INVALID_ARGUMENT naming the field, and the server's
state exactly as it was (nothing applied, no counter moved).

A warm server (index 0 of 2, two sync trainers, dense blocks in two param groups, a
preallocated and a lazy table, a push of step 0 pending, a barrier arrival, a checkpoint, a
restore begun) answers one valid frame per request type. Each test frame changes one thing of
such a frame: a meta field at any depth (NaN/inf, negative and huge integers, wrong types,
out-of-range trainer ids, steps and counts, unknown names), an added unknown field, a tensor
(wrong dtype, shape, length, ids outside the shard or the table), or the bytes (truncated,
trailing, bad magic).
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from longboat.ps.server import CallError, Server
from longboat.ps.shared import wire
from longboat.ps.shared.auth import METADATA_KEY, generate_token
from longboat.ps.shared.service import SERVICE
from longboat.ps.shared.wire import Message
from tests.ps._fingerprint import fingerprint

NAN, INF = float("nan"), float("inf")
W_SPEC = {"key": "w", "update": "optimizer", "optimizer": "sgd", "hparams": {"lr": 0.1}}
C_SPEC = {**W_SPEC, "key": "c", "group": 1, "reduce": "mean"}
V_SPEC = {"key": "v", "update": "optimizer", "optimizer": "adagrad", "hparams": {"lr": 0.1}}
T_SPEC = {"name": "t", "rows": 40, "dim": 4, "dtype": "float32", "optimizer": "adagrad",
          "hparams": {"lr": 0.1}, "seed": 3, "scale": 0.01}  # fmt: skip
Z_SPEC = {"name": "z", "rows": 0, "dim": 4, "optimizer": "sgd", "hparams": {"lr": 0.1},
          "lazy": True, "admission": {"count": 1, "probability": 1.0}, "evict_after": 2,
          "expected_rows": 8, "storage": "float16"}  # fmt: skip
U_SPEC = {"name": "u", "rows": 10, "dim": 2, "optimizer": "sgd"}
Y_SPEC = {"name": "y", "dim": 2, "optimizer": "sgd", "lazy": True}
SETTINGS = {"trainers": 2, "mode": "sync", "lr": NAN}  # opaque to the server: NaN may be in it


def _ids(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)


def _warm(checkpoint_dir: Path) -> Server:
    """Server 0 of 2 after trainer 0 initialised the job, said hello, joined, pushed step 0,
    reached barrier x/1, saved and asked to restore step 0 (both still waiting for trainer 1)."""
    server = Server(index=0, num_servers=2, token="t", checkpoint_dir=checkpoint_dir)
    steps: list[tuple[str, Message, grpc.StatusCode | None]] = [
        ("init", Message({"trainer": 0, "trainers": 2, "sync": True, "digest": "plan",
                          "blocks": [W_SPEC, C_SPEC], "tables": [T_SPEC, Z_SPEC]},
                         {"w": torch.ones(3, 4), "c": torch.zeros(2)}), None),
        ("hello", Message({"scope": "engine", "trainer": 0, "settings": SETTINGS}), None),
        ("join", Message({"trainer": 0, "step": 0}), None),
        ("push", Message({"trainer": 0, "step": 0, "lrs": [0.1, 0.1]},
                         {"w": torch.ones(3, 4), "t@ids": _ids(0, 2), "t@grad": torch.ones(2, 4),
                          "z@ids": _ids(4), "z@grad": torch.ones(1, 4)}), None),
        ("barrier", Message({"trainer": 0, "name": "x", "generation": 1, "trainers": 2}),
         grpc.StatusCode.DEADLINE_EXCEEDED),
        ("save", Message(), None),
        ("restore", Message({"trainer": 0, "step": 0, "generation": 1}),
         grpc.StatusCode.DEADLINE_EXCEEDED),
    ]  # fmt: skip
    for method, msg, code in steps:
        try:
            server.answer(method, wire.encode(msg), time.monotonic())
            assert code is None, f"warm-up {method} was answered"
        except CallError as exc:
            assert exc.code == code, f"warm-up {method}: {exc.code} {exc.details}"
    return server


#: one valid request of every type (and of each form some take), from trainer 1
BASES: list[tuple[str, dict[str, Any], dict[str, torch.Tensor]]] = [
    ("init", {"trainer": 1, "trainers": 2, "sync": True, "digest": "plan",
              "blocks": [W_SPEC, C_SPEC, V_SPEC], "tables": [T_SPEC, Z_SPEC, U_SPEC, Y_SPEC]},
     {"v": torch.ones(5)}),
    ("push", {"trainer": 1, "step": 0, "lrs": [0.1, 0.2],
              "pull": {"keys": ["w"], "version": 1, "trainer": 1}},
     {"w": torch.ones(3, 4), "c": torch.ones(2), "t@ids": _ids(0, 2), "t@grad": torch.ones(2, 4),
      "z@ids": _ids(6), "z@grad": torch.ones(1, 4)}),
    ("pull", {"keys": ["w", "c"], "version": 0, "trainer": 1},
     {"t@ids": _ids(0, 4), "z@ids": _ids(2), "w@ids": _ids(0, 2)}),
    ("barrier", {"trainer": 1, "name": "x", "generation": 1, "trainers": 2}, {}),
    ("ping", {"keys": ["w"], "tables": ["t"], "version": 1, "table_stats": True}, {}),
    ("ping", {"barrier": ["x", 1]}, {}),
    ("save", {}, {}),
    ("restore", {"trainer": 1, "step": 0, "generation": 1}, {}),
    ("configure", {"blocks": [{**C_SPEC, "hparams": {"lr": 0.1, "momentum": 0.5}}]}, {}),
    ("configure", {"shrink": ["z"]}, {}),
    ("stop", {"trainer": 1}, {}),
    ("hello", {"scope": "engine", "trainer": 1, "settings": SETTINGS}, {}),
    ("join", {"trainer": 1, "step": 0}, {}),
]  # fmt: skip

# ---- one change each ------------------------------------------------------------------------

WRONG_TYPES: dict[type, list[Any]] = {
    bool: [1, 0, "true", NAN, None, [], {}],
    int: [-1, -(1 << 63) - 1, 1 << 63, 1 << 70, 0.5, NAN, INF, -INF, "1", None, True, [], {}],
    float: [NAN, INF, -INF, "0.1", None, True, [], {}],
    str: [1, 0.5, NAN, None, True, [], {}],
    list: ["x", 1, NAN, None, {}, True],
    dict: ["x", 1, NAN, None, [], True],
}
#: values of the right type that are still wrong, by field name ("name[]": the elements of a
#: list), by (method, field) where a field means more in one request, and by (method, path)
OUT_OF_RANGE: dict[str, list[Any]] = {
    "trainer": [2, 1 << 40],  # the job has 2 trainers
    "trainers": [0, 3, 1 << 40],
    "step": [-2],
    "group": [1 << 40],
    "seed": [1 << 63],
    "count": [0],
    "probability": [0.0, 1.5],
    "lrs": [[], [0.1]],  # the push carries a block of param group 1
    "lrs[]": [-0.1],
    "lr": [-0.1],
    "scope": ["bogus"],
    "update": ["bogus"],
    "reduce": ["bogus"],
    "optimizer": ["bogus"],
    "dtype": ["int64", "bogus"],
    "storage": ["bogus"],
    "digest": ["another plan"],
    "barrier": [["x"], ["x", 1, 2]],
}
BY_METHOD: dict[tuple[str, str], list[Any]] = {
    ("pull", "keys[]"): ["nope"],
    ("push", "keys[]"): ["nope"],  # its pull entry
    ("push", "trainer"): [0],  # trainer 0 pushed step 0 already
    ("restore", "step"): [5],  # no checkpoint of step 5
    ("configure", "shrink[]"): ["nope", "t"],  # unknown, not lazy
    ("configure", "key"): ["", "nope"],
    ("configure", "optimizer"): ["adam"],  # adam has no momentum
    ("init", "key"): [""],
    ("init", "name"): [""],
}
BY_PATH: dict[tuple[str, tuple[Any, ...]], list[Any]] = {  # tables the init creates
    ("init", ("tables", 0, "rows")): [0],  # preallocated
    ("init", ("tables", 2, "rows")): [1 << 62],
    ("init", ("tables", 2, "dim")): [0, 1 << 40],
    ("init", ("tables", 3, "dim")): [0, 1 << 40],
    ("init", ("tables", 3, "expected_rows")): [1 << 50],
}
VALID_TOO: dict[tuple[str, str], list[Any]] = {("configure", "shrink"): [True]}  # all lazy tables


def _walk(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every value in a meta, at any depth, with its path (a hello's settings are opaque)."""
    if path:
        yield path, value
    if path[-1:] == ("settings",):
        return
    if isinstance(value, dict | list):
        for k, v in value.items() if isinstance(value, dict) else enumerate(value):
            yield from _walk(v, (*path, k))


def _field(path: tuple[Any, ...]) -> str:
    """The name a refusal of the value at ``path`` must mention (the nearest key)."""
    return next(str(k) for k in reversed(path) if isinstance(k, str))


def _replaced(meta: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    out = json.loads(json.dumps(meta))
    holder = out
    for k in path[:-1]:
        holder = holder[k]
    holder[path[-1]] = value
    return out


def _meta_changes(method: str, meta: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], str]]:
    """(what changed, the meta, the field its refusal names)."""
    for path, value in _walk(meta):
        name = _field(path)
        kind = name if isinstance(path[-1], str) else f"{name}[]"
        wrong = [*WRONG_TYPES[type(value)], *OUT_OF_RANGE.get(kind, [])]
        wrong += BY_METHOD.get((method, kind), []) + BY_PATH.get((method, path), [])
        valid = VALID_TOO.get((method, kind), [])
        wrong = [v for v in wrong if not any(type(v) is type(ok) and v == ok for ok in valid)]
        for bad in wrong:
            yield f"{'.'.join(map(str, path))}={bad!r}", _replaced(meta, path, bad), name
    for path, value in [((), meta), *_walk(meta)]:
        if isinstance(value, dict) and path[-1:] != ("settings",):
            where = (*path, "bogus")
            yield f"{'.'.join(map(str, where))} added", _replaced(meta, where, 1), "bogus"


def _tensor_changes(method: str, tensors: dict[str, torch.Tensor]) -> list[tuple[str, dict, str]]:
    """(what changed, the tensors, the tensor its refusal names)."""
    t, g = _ids(0, 2), torch.ones(2, 4)
    if method == "push":
        return [
            *((f"w as {desc}", {**tensors, "w": bad}, "w") for desc, bad in [
                ("float64", torch.ones(3, 4, dtype=torch.float64)),
                ("int64", torch.ones(3, 4, dtype=torch.int64)),
                ("flat", torch.ones(12)), ("5x3", torch.ones(5, 3)),
                ("0-d", torch.tensor(1.0)), ("0x4", torch.ones(0, 4)),
            ]),
            ("unknown block", {**tensors, "nope": torch.ones(3)}, "nope"),
            *((f"t@ids {desc}", {**tensors, "t@ids": bad, "t@grad": g[: len(bad)]}, "t")
              for desc, bad in [
                ("int32", t.int()), ("float", t.float()),
                ("odd: another server's", _ids(1, 3)), ("past the rows", _ids(40, 42)),
                ("negative", _ids(-2, 0)), ("huge", _ids(1 << 40, 0)),
            ]),
            ("t@ids 2-D", {**tensors, "t@ids": t.reshape(2, 1)}, "t"),
            ("t@grad missing", {k: v for k, v in tensors.items() if k != "t@grad"}, "t"),
            ("t@ids missing", {k: v for k, v in tensors.items() if k != "t@ids"}, "t"),
            ("t@grad 2x5", {**tensors, "t@grad": torch.ones(2, 5)}, "t"),
            ("t@grad 3 rows", {**tensors, "t@grad": torch.ones(3, 4)}, "t"),
            ("t@grad float64", {**tensors, "t@grad": g.double()}, "t"),
            ("t@grad 1-D", {**tensors, "t@grad": torch.ones(8)}, "t"),
            ("t@rows", {**tensors, "t@rows": g}, "t@rows"),
            ("unknown table", {**tensors, "nope@ids": t, "nope@grad": g}, "nope"),
            ("z@ids odd", {**tensors, "z@ids": _ids(7)}, "z"),
        ]  # fmt: skip
    if method == "pull":
        return [
            *((f"t@ids {desc}", {**tensors, "t@ids": bad}, "t") for desc, bad in [
                ("int32", t.int()), ("float", t.float()), ("2-D", t.reshape(2, 1)),
                ("odd", _ids(1)), ("past the rows", _ids(40)), ("negative", _ids(-2)),
            ]),
            *((f"w@ids {desc}", {**tensors, "w@ids": bad}, "w") for desc, bad in [
                ("unsorted", _ids(2, 0)), ("repeated", _ids(0, 0)), ("past the rows", _ids(3)),
                ("negative", _ids(-1)), ("int32", t.int()),
            ]),
            ("a block's value", {**tensors, "w": torch.ones(3, 4)}, "w"),
            ("unknown table", {**tensors, "nope@ids": t}, "nope"),
            ("z@ids odd", {**tensors, "z@ids": _ids(3)}, "z"),
        ]  # fmt: skip
    if method == "init":
        return [
            ("value without a spec", {**tensors, "nope": torch.ones(2)}, "nope"),
            ("w of another shape", {**tensors, "w": torch.ones(3)}, "w"),
            ("w of another dtype", {**tensors, "w": torch.ones(3, 4, dtype=torch.float64)}, "w"),
            ("v int64", {**tensors, "v": torch.ones(5, dtype=torch.int64)}, "v"),
        ]
    return [("a tensor", {**tensors, "x": torch.ones(1)}, "x")]


def _frame_changes(frame: bytes) -> list[tuple[str, bytes]]:
    return [
        ("last byte cut", frame[:-1]),
        ("half cut", frame[: len(frame) // 2]),
        ("header only", frame[: wire._HEADER.size]),
        ("a byte after", frame + b"\0"),
        ("bad magic", b"LBPX" + frame[4:]),
        ("version 2", frame[:4] + bytes([2]) + frame[5:]),
    ]


def _names(details: str, name: str) -> bool:
    """Whether ``details`` names ``name`` (quoted, in a path, or as a word of its own)."""
    return re.search(rf"[\s'.\[(]{re.escape(name)}['\].@\[\s:)]", details) is not None


def _cases() -> Iterator[tuple[str, str, bytes, str]]:
    """(method, what changed, the frame, the field its refusal must name)."""
    for method, meta, tensors in BASES:
        for what, bad, name in _meta_changes(method, meta):
            yield method, what, wire.encode(Message(bad, tensors)), name
        for what, bad_tensors, name in _tensor_changes(method, tensors):
            yield method, what, wire.encode(Message(meta, bad_tensors)), name
        for what, frame in _frame_changes(wire.encode(Message(meta, tensors))):
            yield method, what, frame, "frame"


@pytest.mark.parametrize(("method", "meta", "tensors"), BASES, ids=[b[0] for b in BASES])
def test_each_valid_request_is_answered(
    tmp_path: Path, method: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> None:
    """The frames the changes start from are valid: a warm server answers each."""
    server = _warm(tmp_path)
    try:
        server.answer(method, wire.encode(Message(meta, tensors)), time.monotonic())
    finally:
        server.stop(0)


def test_every_malformed_request_is_refused_whole(tmp_path: Path) -> None:
    cases = list(_cases())
    wrong: list[str] = []
    servers = [_warm(tmp_path / "0")]
    try:
        for method, what, frame, name in cases:
            server = servers[-1]
            before = fingerprint(server)
            try:
                server.answer(method, frame, time.monotonic())
                got = "answered OK"
            except CallError as exc:
                got = f"{exc.code.name}: {exc.details}"
                if exc.code == grpc.StatusCode.INVALID_ARGUMENT and (
                    _names(exc.details, name)
                    or name == "frame"
                    and "malformed frame" in exc.details
                ):
                    got = ""
                elif exc.code == grpc.StatusCode.INVALID_ARGUMENT:
                    got = f"(does not name {name!r}) {got}"
            if fingerprint(server) != before:
                got += " -- and the server's state changed"
                servers.append(_warm(tmp_path / str(len(servers))))  # the next starts afresh
            if got:
                wrong.append(f"{method} with {what}: {got}")
    finally:
        for server in servers:
            server.stop(0)
    assert len(cases) > 1000
    assert not wrong, f"{len(wrong)} of {len(cases)} malformed requests:\n" + "\n".join(wrong)


def test_non_finite_numbers_anywhere_in_meta_are_named() -> None:
    server = Server(index=0, num_servers=2, token="t")
    try:
        for meta in ({"trainer": 0, "step": 0, "lrs": [0.1, INF]}, {"trainer": 0, "x": NAN}):
            with pytest.raises(CallError) as info:
                server.answer("push", wire.encode(Message(meta)), time.monotonic())
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "'lrs[1]'" in info.value.details or "'x'" in info.value.details
    finally:
        server.stop(0)


@pytest.mark.parametrize(
    ("method", "meta", "field"),
    [
        ("init", {"trainer": 5, "trainers": 2}, "'trainer'"),
        ("pull", {"keys": [], "version": 0, "trainer": 7}, "'trainer'"),
        ("push", {"trainer": 0, "step": math.inf}, "'step'"),
        ("barrier", {"trainer": 0, "generation": -3}, "'generation'"),
    ],
)
def test_refusals_travel_as_invalid_argument(method: str, meta: dict[str, Any], field: str) -> None:
    """Over gRPC, with the job's token: the status and the field reach the caller."""
    token = generate_token()
    server = Server(index=0, num_servers=1, token=token).start()
    try:
        with grpc.insecure_channel(server.endpoint) as channel:
            call = channel.unary_unary(f"/{SERVICE}/{method}")
            with pytest.raises(grpc.RpcError) as info:
                call(wire.encode(Message(meta)), timeout=30, metadata=[(METADATA_KEY, token)])
    finally:
        server.stop(0)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert field in info.value.details()
