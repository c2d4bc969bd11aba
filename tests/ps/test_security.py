"""Security and limits: callers without the token cost the servers nothing, slow bodies are cut
off, malformed frames are INVALID_ARGUMENT, and trainers agree with their servers' settings."""

from __future__ import annotations

import contextlib
import json
import random
import struct
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
import torch.nn.functional as F

import longboat as lb
from longboat.ps.server import CallError, Server, guard, limits
from longboat.ps.server.limits import ServerLimits
from longboat.ps.shared import wire
from longboat.ps.shared.auth import METADATA_KEY, generate_token
from longboat.ps.shared.service import SERVICE
from longboat.ps.shared.wire import Message
from longboat.ps.trainer.client import Client
from longboat.ps.trainer.kv import KVClient
from longboat.ps.trainer.settings import SettingsMismatch
from tests.collective import _workloads as W
from tests.ps._attack import SlowCalls, SlowFlood, big_calls, memory_kb
from tests.ps._harness import server_processes

X, Y = W.data(W.Config())
DOCS = Path(__file__).resolve().parents[2] / "docs" / "ps.md"


@contextlib.contextmanager
def running(n: int = 1, **settings: Any) -> Iterator[tuple[list[Server], str]]:
    """``n`` started in-process servers (the objects, for their gate and state); stopped after."""
    token = generate_token()
    started: list[Server] = []
    try:
        for i in range(n):
            started.append(Server(index=i, num_servers=n, token=token, **settings).start())
        yield started, token
    finally:
        for s in started:
            s.stop(0)


def _trainer(
    eps: list[str],
    token: str,
    rank: int,
    momentum: float = 0.9,
    model: Any = None,
    **fields: Any,
) -> Any:
    """Sync trainer ``rank`` of 2 (MixedNet, momentum SGD as the reference's, ``momentum``);
    its PSModel. ``fields`` change the Strategy."""
    model = W.build_model(W.Config(), seed=0) if model is None else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    strategy = lb.Strategy(mode="ps", **({"a_sync": False} | fields))
    where = {"servers": eps, "trainer": rank, "trainers": 2, "token": token}
    m, _ = lb.ps.distribute(model, opt, strategy, timeout=60, **where)
    return m


def _trainers(eps: list[str], token: str) -> list[Any]:
    """Two sync trainers connected at once (threads of this process): their PSModels."""
    models = [W.build_model(W.Config(), seed=0) for _ in range(2)]  # global RNG: not in threads
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda r: _trainer(eps, token, r, model=models[r]), range(2)))


def _train(trainers: list[Any], steps: int) -> None:
    """``steps`` sync steps of every trainer, each on its shard of the global batch."""
    world = len(trainers)

    def one(rank: int, i: int) -> None:
        m = trainers[rank]
        m.engine.optimizer.zero_grad()
        F.cross_entropy(m(W.shard(X[i], rank, world)), W.shard(Y[i], rank, world)).backward()
        m.engine.step()

    with ThreadPoolExecutor(world) as pool:
        for i in range(steps):
            list(pool.map(one, range(world), [i] * world))
    for m in trainers:
        m.engine.synchronize()


# ---- callers without the token -------------------------------------------------------------


def test_sync_job_under_unauthenticated_flood_trains_as_if_undisturbed() -> None:
    """2 servers x 2 trainers, while 64 slow calls per server keep coming and 8 calls of 200 MB
    hit server 0, all without the token: the job ends equal to single-process training on
    the global batch (what an undisturbed sync job gives) and no server grows by 300 MB."""
    token = generate_token()
    with server_processes(2, token) as procs, contextlib.ExitStack() as stack:
        pids = [p.proc.pid for p in procs if p.proc is not None]
        trainers = _trainers([p.endpoint for p in procs], token)
        stack.callback(lambda: [m.engine.close() for m in trainers])
        before = [memory_kb(pid)["VmRSS"] for pid in pids]
        floods = [stack.enter_context(SlowFlood(p.endpoint, 64)) for p in procs]
        for flood in floods:  # the floods are on before the first step, and stay on
            flood.wait_waves(1)
        with ThreadPoolExecutor(1) as pool:
            big = pool.submit(big_calls, procs[0].endpoint, 8, 200 << 20)
            _train(trainers, W.STEPS)
            refused = big.result()
        for flood in floods:
            flood.wait_waves(2)
        grown = [memory_kb(pid)["VmHWM"] - b for pid, b in zip(pids, before, strict=True)]
        got = [{n: p.detach().clone() for n, p in m.module.named_parameters()} for m in trainers]
    assert {code for code, _ in refused} == {grpc.StatusCode.UNAUTHENTICATED}
    assert [f.held for f in floods] == [0, 0], "a server let slow unauthenticated calls stay"
    cfg = W.Config()
    model = W.build_model(cfg, seed=0)
    want = W.train_global_batch(model, W.build_optimizer(cfg, model), cfg, 2)
    for params in got:
        for name, value in params.items():
            torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-5)
    assert max(grown) < 300 << 10, f"server peak RSS grew by {[g >> 10 for g in grown]} MB"


def test_refusal_never_waits_for_the_body() -> None:
    with running(1) as ([server], token):
        ep = server.endpoint
        body_sent = threading.Event()
        with grpc.insecure_channel(ep) as channel:
            never = channel.stream_unary(f"/{SERVICE}/push")
            try:
                with pytest.raises(grpc.RpcError) as info:
                    never(iter(body_sent.wait, True), timeout=60)  # a body that never comes
            finally:
                body_sent.set()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with contextlib.closing(SlowCalls(ep, 64)) as slow:
            assert slow.wait_closed(60), f"{len(slow.closed)} of 64 slow calls ended"
        assert server.gate.refused >= 65
        client = Client([ep], token, timeout=30)
        assert client.call(0, "ping", Message()).meta["index"] == 0
        client.close()


def test_a_body_that_does_not_arrive_is_cut_off_even_with_the_token() -> None:
    with running(1, limits=ServerLimits(body_timeout_s=0.5)) as ([server], token):
        meta = [(METADATA_KEY, token)]
        with contextlib.closing(SlowCalls(server.endpoint, 4, metadata=meta)) as slow:
            assert slow.wait_closed(60), "the server still waits for the bodies"
        assert server.gate.refused == 0
        client = Client([server.endpoint], token, timeout=30)
        assert client.call(0, "ping", Message()).meta["index"] == 0
        client.close()


def test_alarms_fire_in_order_and_cancelled_ones_never() -> None:
    alarms = guard.Alarms()
    fired: list[str] = []
    last = threading.Event()
    now = time.monotonic()
    alarms.arm(now + 0.01, lambda: fired.append("first"))
    alarms.cancel(alarms.arm(now + 0.02, lambda: fired.append("cancelled")))
    alarms.arm(now + 0.03, lambda: (fired.append("last"), last.set()))
    far = [alarms.arm(now + 3600, lambda: fired.append("far")) for _ in range(200)]
    for entry in far:
        alarms.cancel(entry)
    assert last.wait(60)
    alarms.close()
    assert fired == ["first", "last"]
    assert len(alarms._heap) < 100  # cancelled alarms do not pile up


def test_limits_come_from_the_environment_and_are_documented() -> None:
    got = ServerLimits.from_env({"LONGBOAT_PS_MAX_CALLS": "8", "LONGBOAT_PS_BODY_TIMEOUT": "2.5"})
    assert got.max_calls == 8 and got.body_timeout_s == 2.5 and got.max_streams == 128
    with pytest.raises(ValueError, match="LONGBOAT_PS_MAX_STREAMS"):
        ServerLimits.from_env({"LONGBOAT_PS_MAX_STREAMS": "0"})
    with pytest.raises(ValueError, match="LONGBOAT_PS_MAX_CALLS='many'"):
        ServerLimits.from_env({"LONGBOAT_PS_MAX_CALLS": "many"})
    doc = DOCS.read_text()
    for name, var in limits.ENV.items():
        default = getattr(ServerLimits(), name)
        assert f"`{var}`" in doc and f"{default:g}" in doc.split(var, 1)[1][:200], var


# ---- malformed frames with the token ---------------------------------------------------------


def _frame(meta_json: bytes, entries: bytes = b"", count: int = 0) -> bytes:
    return wire._HEADER.pack(wire.MAGIC, 1, 0, 0, count, len(meta_json)) + meta_json + entries


def _msg(meta: dict[str, Any], **tensors: torch.Tensor) -> bytes:
    return wire.encode(Message(meta, tensors))


ADAM = {"key": "w", "update": "optimizer", "optimizer": "adam"}
HUGE_SHAPE = struct.pack("<HBB", 1, 0, 3) + b"x" + struct.pack("<3q", 1 << 62, 1 << 62, 0)
HUGE_SEED = {"name": "t", "rows": 4, "dim": 2, "optimizer": "sgd", "seed": 1 << 70}
MALFORMED = [
    ("push", b"", "shorter than the 20-byte header"),
    ("push", _frame(b"[" * 30000 + b"]" * 30000), "meta is not valid JSON"),
    ("pull", _frame(b"{}", HUGE_SHAPE, 1), "cannot be built"),
    ("init", _msg({"trainers": 0}), "'trainers' must be an integer in [1, 65536], got 0"),
    (
        "init",
        _msg({"blocks": [{**ADAM, "hparams": {"betas": [0.9]}}]}, w=torch.ones(2)),
        "'blocks[0].hparams.betas' must be a list of 2 numbers",
    ),
    (
        "init",
        _msg({"blocks": [{"key": "w"}]}, w=torch.ones(2)),
        "'blocks[0].optimizer' must be given",
    ),
    ("init", _msg({"blocks": [ADAM]}, w=torch.ones(2, dtype=torch.int64)), "floating-point value"),
    ("init", _msg({"tables": [HUGE_SEED]}), "'tables[0].seed' must be an integer in [0, 2**63"),
    ("push", _msg({"lrs": [float("nan")]}), "'lrs[0]' must be a finite number"),
    ("pull", _msg({}, w=torch.ones(2)), "only '<table>@ids' tensors"),
    ("stop", _msg({"trainer": float("inf")}), "'trainer' must be a finite number"),
    ("ping", _msg({"barrier": "x"}), "'barrier' must be [name, generation]"),
    ("barrier", _msg({"trainers": -1}), "'trainers' must be an integer in [1, 65536]"),
    ("hello", _msg({"scope": "other", "settings": {}}), "'scope' must be one of"),
    ("configure", _msg({"blocks": [{"key": "nope", "update": "assign"}]}), "no block 'nope'"),
]


@pytest.mark.parametrize(("method", "frame", "match"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_frame_with_the_token_is_invalid_argument(
    method: str, frame: bytes, match: str
) -> None:
    with running(1) as ([server], token), grpc.insecure_channel(server.endpoint) as channel:
        call = channel.unary_unary(f"/{SERVICE}/{method}")
        with pytest.raises(grpc.RpcError) as info:
            call(frame, timeout=30, metadata=[(METADATA_KEY, token)])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert match in info.value.details()


def test_a_call_without_a_request_message_is_invalid_argument() -> None:
    with running(1) as ([server], token), grpc.insecure_channel(server.endpoint) as channel:
        empty = channel.stream_unary(f"/{SERVICE}/push")
        with pytest.raises(grpc.RpcError) as info:
            empty(iter(()), timeout=30, metadata=[(METADATA_KEY, token)])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no request message" in info.value.details()


def _valid_frames() -> list[tuple[str, bytes]]:
    table = {"name": "t", "rows": 40, "dim": 4, "optimizer": "adagrad", "hparams": {"lr": 0.1}}
    block = {"key": "w", "update": "optimizer", "optimizer": "sgd", "hparams": {"lr": 0.1}}
    ids, rows = torch.tensor([0, 2, 6]), torch.ones(3, 4)
    init = {"trainers": 2, "sync": True, "blocks": [block], "tables": [table]}
    push = {"trainer": 1, "step": 0, "lrs": [0.1]}
    return [
        ("init", _msg(init, w=torch.ones(3, 4))),
        ("push", _msg(push, **{"w": torch.ones(3, 4), "t@ids": ids, "t@grad": rows})),
        ("pull", _msg({"keys": ["w"], "version": 0}, **{"t@ids": ids})),
        ("barrier", _msg({"trainer": 1, "name": "x", "generation": 1})),
        ("ping", _msg({"keys": ["w"], "tables": ["t"], "version": 1})),
        ("configure", _msg({"blocks": [block]})),
        ("hello", _msg({"scope": "kv", "trainer": 1, "settings": {"a": [1]}})),
        ("stop", _msg({"trainer": 1})),
        ("restore", _msg({"trainer": 1, "step": 0, "generation": 1})),
    ]


ODD_VALUES: list[Any] = [
    *(0, -1, 7, 1 << 70, 0.5, float("nan"), float("inf"), None, True),
    *("", "w", "t@ids", "kv", "sgd", "adam", "sum"),
    *([], [1], ["w"], [0.9], {}, {"lr": -1}, {"key": "w"}, [{"key": "w", "update": "optimizer"}]),
]


def _corrupt_bytes(rng: random.Random, frame: bytes) -> bytes:
    data = bytearray(frame)
    for _ in range(rng.randint(1, 4)):
        kind = rng.random()
        if kind < 0.6:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif kind < 0.8:
            del data[rng.randrange(len(data)) :]
        else:
            data[rng.randrange(len(data) + 1) : 0] = rng.randbytes(rng.randint(1, 9))
        if not data:
            break
    return bytes(data)


def _corrupt_fields(rng: random.Random, frame: bytes) -> bytes:
    """A well-formed frame with a meta value (at any depth) or a tensor replaced."""
    msg = wire.decode(frame)
    meta = json.loads(json.dumps(msg.meta))
    tensors = dict(msg.tensors)
    if tensors and rng.random() < 0.3:
        name = rng.choice(list(tensors))
        t = tensors.pop(name)
        odd = [t.to(torch.int64), t.to(torch.float64), t.reshape(-1), t.reshape(-1)[:0]]
        odd += [torch.zeros(5, 3), torch.tensor([-7, 1 << 40, 39])]
        tensors[rng.choice([name, name, "w", "t@ids", "t@grad", "t@rows", "x@y"])] = rng.choice(odd)
    else:
        holder: Any = meta
        key: Any = rng.choice(list(meta))
        while isinstance(holder[key], dict | list) and holder[key] and rng.random() < 0.6:
            holder = holder[key]
            key = rng.choice(list(holder) if isinstance(holder, dict) else range(len(holder)))
        holder[key] = json.loads(json.dumps(rng.choice(ODD_VALUES)))
    return wire.encode(Message(meta, tensors))


def test_no_corruption_of_a_frame_gets_an_unexpected_status() -> None:
    """Thousands of corrupted frames (bytes, or single fields of well-formed ones) for every
    method: each is answered, or refused with INVALID_ARGUMENT / FAILED_PRECONDITION /
    DEADLINE_EXCEEDED naming the problem, never an internal error."""
    rng = random.Random(0)
    status = grpc.StatusCode
    allowed = {status.INVALID_ARGUMENT, status.FAILED_PRECONDITION, status.DEADLINE_EXCEEDED}
    server = Server(token="t", num_servers=2, index=0)
    try:
        frames = _valid_frames()
        server.answer("init", frames[0][1], time.monotonic() + 10)
        codes: dict[grpc.StatusCode, int] = {}
        for i in range(4000):
            method, frame = frames[i % len(frames)]
            corrupt = _corrupt_bytes if i % 2 else _corrupt_fields
            data = corrupt(rng, frame)
            try:
                server.answer(method, data, time.monotonic())  # waits end at once
            except CallError as exc:
                assert exc.code in allowed, f"{method} {data!r}: {exc.code} {exc}"
                assert exc.details
                codes[exc.code] = codes.get(exc.code, 0) + 1
        assert codes[grpc.StatusCode.INVALID_ARGUMENT] > 2000
    finally:
        server.stop(0)


# ---- trainers agree with their servers --------------------------------------------------------


def _said_hello(servers: list[Server], scope: str, trainer: Future[Any]) -> None:
    """Wait until every server keeps the settings of ``scope`` that ``trainer`` sent."""
    while not all(scope in s.state.settings for s in servers):
        if trainer.done():
            trainer.result()  # what it raised
        time.sleep(0.01)


def test_second_trainer_with_another_momentum_is_refused_naming_the_field() -> None:
    with ThreadPoolExecutor(1) as pool, running(2) as (servers, token):  # servers stop first
        eps = [s.endpoint for s in servers]
        model = W.build_model(W.Config(), seed=0)  # the global RNG: not in a thread
        first = pool.submit(_trainer, eps, token, 0, model=model)  # waits for trainer 1
        _said_hello(servers, "engine", first)
        with pytest.raises(SettingsMismatch) as info:
            _trainer(eps, token, 1, momentum=0.5)
        second = _trainer(eps, token, 1)  # the fix lets the job start
        trainers = [first.result(), second]
        for m in trainers:
            m.engine.close()
    err = info.value
    assert (err.field, err.trainer_value, err.server_value) == (
        "param_groups[0].momentum",
        0.5,
        0.9,
    )
    assert "trainer 1 does not agree with parameter server 0" in str(err)
    assert "kept from trainer 0, the first to connect" in str(err)
    assert "Fix: give every trainer's optimizer the same param groups" in str(err)


@pytest.mark.parametrize(
    ("fields", "mine"),
    [({"a_sync": True}, "async"), ({"a_sync": True, "a_sync_configs": {"k_steps": 4}}, "geo")],
)
def test_trainer_in_another_mode_is_refused(fields: dict[str, Any], mine: str) -> None:
    with ThreadPoolExecutor(1) as pool, running(2) as (servers, token):  # servers stop first
        eps = [s.endpoint for s in servers]
        model = W.build_model(W.Config(), seed=0)  # the global RNG: not in a thread
        first = pool.submit(_trainer, eps, token, 0, model=model)
        _said_hello(servers, "engine", first)
        expected = f'on mode: this trainer has "{mine}", the server has "sync"'
        with pytest.raises(SettingsMismatch, match=expected):
            _trainer(eps, token, 1, **fields)
        second = _trainer(eps, token, 1)  # the fix lets the job start
        trainers = [first.result(), second]
        for m in trainers:
            m.engine.close()


def test_servers_own_settings_are_checked_at_connect() -> None:
    with running(2) as (servers, token):
        eps = [s.endpoint for s in servers]
        swapped = KVClient(eps[::-1], token)
        expected = "on server_index: this trainer has 0, the server has 1 .the server's own"
        with pytest.raises(SettingsMismatch, match=expected):
            swapped.init("w", torch.zeros(4))
        swapped.close()
        small = Client(eps, token, max_bytes=1 << 20)
        small_kv = KVClient(eps, token)
        small_kv.client.close()
        small_kv.client = small
        with pytest.raises(SettingsMismatch, match="max_message_bytes.*LONGBOAT_PS_MAX_MESSAGE_MB"):
            small_kv.init("w", torch.zeros(4))
        small_kv.close()


def test_kv_clients_with_different_settings_do_not_both_train() -> None:
    with running(2) as (servers, token):
        eps = [s.endpoint for s in servers]
        first = KVClient(eps, token, trainer=0, trainers=2, sync=True)
        first.init("w", torch.zeros(4))
        second = KVClient(eps, token, trainer=1, trainers=2, sync=False)
        with pytest.raises(SettingsMismatch) as info:
            second.init("w", torch.zeros(4))
        for kv in (first, second):
            kv.close()
        saved = servers[0].state.state_dict()
    err = info.value
    assert (err.field, err.trainer_value, err.server_value) == ("sync", False, True)
    assert "create every kv client with the same sync=" in str(err)
    restarted = Server(index=0, num_servers=2, token=token)
    try:  # a restarted server keeps the settings it agreed on (checkpoints carry them)
        restarted.state.load_state_dict(saved)
        assert restarted.state.settings["kv"]["settings"]["sync"] is True
    finally:
        restarted.stop(0)
