"""Security and faults: tokens, hostile frames, dead and restarted servers."""

from __future__ import annotations

import os
import random
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
import torch.nn.functional as F

import longboat as lb
from longboat.ps.shared import wire
from longboat.ps.shared.auth import METADATA_KEY, generate_token
from longboat.ps.shared.service import SERVICE
from longboat.ps.shared.wire import Message
from longboat.ps.trainer.client import Client, PSError
from tests._dist import free_port
from tests.collective import _workloads as W
from tests.ps._harness import server_processes, servers

pytestmark = pytest.mark.slow  # slow tier: fault injection: killed servers, hostile floods

X, Y = W.data(W.Config())


def _engines(eps: list[str], token: str, world: int, **kw: Any) -> list[tuple[Any, Any, Any]]:
    """``world`` sync trainers (threads of this process) on the servers ``eps``."""

    cfg = W.Config()
    models = [W.build_model(cfg, seed=0) for _ in range(world)]  # global RNG: not in threads

    def make(rank: int) -> tuple[Any, Any, Any]:
        model = models[rank]
        m, opt = lb.ps.distribute(
            model,
            W.build_optimizer(cfg, model),
            lb.Strategy(mode="ps", a_sync=False),
            servers=eps,
            trainer=rank,
            trainers=world,
            token=token,
            timeout=20,
            **kw,
        )
        return model, m, opt

    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(make, range(world)))


def _step(trainers: list[tuple[Any, Any, Any]], i: int) -> list[BaseException | None]:
    """Step ``i`` on every trainer at once; each trainer's exception (or None)."""
    return _steps(trainers, range(i, i + 1))


def _steps(trainers: list[tuple[Any, Any, Any]], steps: range) -> list[BaseException | None]:
    """Steps ``steps`` on every trainer, each trainer running its own loop on its own thread
    (as separate processes do: a failure one trainer meets in ``step()`` another may meet
    in its next forward); each trainer's exception (or None)."""
    world = len(trainers)

    def loop(rank: int) -> BaseException | None:
        _, m, opt = trainers[rank]
        try:
            for i in steps:
                opt.zero_grad()
                F.cross_entropy(
                    m(W.shard(X[i], rank, world)), W.shard(Y[i], rank, world)
                ).backward()
                opt.step()
        except PSError as exc:
            return exc
        return None

    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(loop, range(world)))


def _all(trainers: list[tuple[Any, Any, Any]], fn: Callable[[Any], Any]) -> list[Any]:
    with ThreadPoolExecutor(len(trainers)) as pool:
        return list(pool.map(lambda t: fn(t[1].engine), trainers))


def _error_of_sync(engine: Any) -> BaseException | None:
    try:
        engine.synchronize()
    except PSError as exc:
        return exc
    return None


def test_wrong_or_missing_token_is_refused() -> None:
    with servers(1) as (eps, token):
        with pytest.raises(PSError, match="UNAUTHENTICATED.*wrong or missing job token"):
            Client(eps, generate_token(), timeout=10).call(0, "ping", Message())
        with grpc.insecure_channel(eps[0]) as channel:
            bare = channel.unary_unary(f"/{SERVICE}/ping")
            with pytest.raises(grpc.RpcError) as info:
                bare(wire.encode(Message()), timeout=10)  # no token at all
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert Client(eps, token, timeout=10).call(0, "ping", Message()).meta["index"] == 0


def _hostile_frames(rng: random.Random, limit: int) -> list[tuple[str, bytes]]:
    """(method, frame) pairs a server must refuse: garbage, lies about sizes, wrong requests."""
    good = wire.encode(Message({"trainer": 0, "step": -1}, {"w/0": torch.ones(4, 4)}))
    huge = bytearray(good)
    kinds: list[tuple[str, bytes]] = []
    for i in range(1000):
        k = i % 10
        if k == 0:
            frame = rng.randbytes(rng.randrange(0, 300))
        elif k == 1:
            frame = good[: rng.randrange(0, len(good))]  # truncated
        elif k == 2:  # a shape of 2**40 elements announced in a tiny frame
            frame = bytes(huge[: -64 - 16]) + struct.pack("<2q", 1 << 20, 1 << 20)
        elif k == 3:
            frame = b"XXXX" + good[4:]
        elif k == 4:
            frame = wire._HEADER.pack(wire.MAGIC, 1, 0, 0, 0, 5) + b"{nope"
        elif k == 5:
            frame = wire.encode(Message({}, {"w/0": torch.ones(5)}))  # wrong shape
        elif k == 6:
            frame = wire.encode(Message({"keys": "w/0"}, {}))  # keys not a list
        elif k == 7:
            frame = wire.encode(Message({"trainer": 7}, {"nope/0": torch.ones(2)}))
        elif k == 8:
            frame = good + b"trailing"
        else:
            frame = bytes(limit + 1024)  # over the message limit
        kinds.append(("pull" if k == 6 else "push", frame))
    return kinds


def test_thousand_hostile_requests_leave_server_correct_with_bounded_memory() -> None:
    token = generate_token()
    limit = 1 << 20
    with server_processes(1, token, env={"LONGBOAT_PS_MAX_MESSAGE_MB": "1"}) as (server,):
        client = Client([server.endpoint], token, timeout=20, max_bytes=limit)
        spec = {"key": "w/0", "update": "optimizer", "optimizer": "sgd", "hparams": {"lr": 0.5}}
        client.call(
            0, "init", Message({"trainers": 1, "blocks": [spec]}, {"w/0": torch.ones(4, 4)})
        )
        with grpc.insecure_channel(server.endpoint) as channel:
            stubs = {m: channel.unary_unary(f"/{SERVICE}/{m}") for m in ("push", "pull")}
            meta = ((METADATA_KEY, token),)
            frames = _hostile_frames(random.Random(0), limit)
            for method, frame in frames[:50]:  # warm up allocator and gRPC buffers
                with pytest.raises(grpc.RpcError):
                    stubs[method](frame, timeout=20, metadata=meta)
            before = server.rss_bytes()
            codes = set()
            for start in range(0, len(frames), 50):  # 50 in flight at a time
                calls = [stubs[m].future(f, timeout=20, metadata=meta)
                         for m, f in frames[start : start + 50]]  # fmt: skip
                for call in calls:
                    with pytest.raises(grpc.RpcError) as info:
                        call.result()
                    codes.add(info.value.code())
            grown = server.rss_bytes() - before
        assert codes <= {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert grown < 32 << 20, f"server RSS grew by {grown >> 20} MB"
        client.call(
            0, "push", Message({"trainer": 0, "step": -1}, {"w/0": torch.full((4, 4), 2.0)})
        )
        value = client.call(0, "pull", Message({"keys": ["w/0"]})).tensors["w/0"]
        assert torch.equal(value, torch.zeros(4, 4))  # 1 - 0.5 * 2: the push was applied once
        client.close()


def test_unreachable_server_is_named_after_bounded_retries() -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    client = Client([endpoint], "token", timeout=5)
    with pytest.raises(PSError, match=f"parameter server 0 at {endpoint} did not answer"):
        client.connect(timeout=0.5)
    client.close()


def test_trainer_gets_error_naming_a_dead_server() -> None:
    token = generate_token()
    with server_processes(2, token) as procs:
        (trainer,) = _engines([p.endpoint for p in procs], token, 1, overlap=False)
        assert _step([trainer], 0) == [None]
        procs[1].kill()
        (error,) = _step([trainer], 1)
        assert isinstance(error, PSError) and error.server == 1
        assert f"parameter server 1 ({procs[1].endpoint})" in str(error)
        trainer[1].engine.close()


def test_restarted_server_resumes_sync_training_from_checkpoint(tmp_path: Path) -> None:
    token = generate_token()
    with server_processes(2, token, checkpoint_dir=tmp_path) as procs:
        trainers = _engines([p.endpoint for p in procs], token, 2)
        for i in range(14):
            assert _step(trainers, i) == [None, None]
            if i == 9:
                assert trainers[0][1].engine.save() == 10  # both servers at step 10
        _all(trainers, lambda e: e.synchronize())
        procs[1].restart()  # loses steps 10..13; comes back from its step-10 checkpoint
        errors = _step(trainers, 14)
        # the step's last push to server 1 also asked for the next values: its failure
        # surfaces when they are awaited (the next forward, or synchronize())
        errors = [e or s for e, s in zip(errors, _all(trainers, _error_of_sync), strict=True)]
        assert all(isinstance(e, PSError) and e.server == 1 for e in errors), errors
        assert _all(trainers, lambda e: e.restore()) == [10, 10]
        for i in range(10, W.STEPS):
            assert _step(trainers, i) == [None, None]
        _all(trainers, lambda e: e.synchronize())
        cfg = W.Config()
        model = W.build_model(cfg, seed=0)
        want = W.train_global_batch(model, W.build_optimizer(cfg, model), cfg, 2)
        for trained, _, _ in trainers:
            for name, p in trained.named_parameters():
                torch.testing.assert_close(p.detach(), want[name], rtol=1e-5, atol=1e-5)
        _all(trainers, lambda e: e.close())


def test_token_file_must_be_private(tmp_path: Path) -> None:
    from longboat.ps.shared.auth import AuthError, load_token, write_token_file

    path = write_token_file(tmp_path / "tok", "secret")
    assert load_token({"LONGBOAT_PS_TOKEN_FILE": str(path)}) == "secret"
    os.chmod(path, 0o644)
    with pytest.raises(AuthError, match=f"chmod 600 {path}"):
        load_token({"LONGBOAT_PS_TOKEN_FILE": str(path)})


def test_periodic_checkpoints_hold_the_values_of_their_step(tmp_path: Path) -> None:
    from longboat.ps.server import checkpoint
    from longboat.ps.trainer.kv import KVClient

    with servers(1, checkpoint_dir=tmp_path, checkpoint_every=2) as (eps, token):
        kv = KVClient(eps, token, sync=True, optimizer="sgd", hparams={"lr": 1.0})
        kv.init("w", torch.zeros(4))
        values = []
        for _ in range(5):
            kv.push("w", torch.ones(4))
            values.append(kv.pull("w"))
        kv.close()
    assert checkpoint.steps_saved(tmp_path, 0) == [0, 2, 4]  # the initial values, then each period
    saved = checkpoint.load(tmp_path, 0, 4)
    assert saved is not None and torch.equal(saved["blocks"]["kv:w/0"]["value"], values[3])


def test_second_backward_with_overlap_is_refused_not_lost() -> None:
    with servers(1) as (eps, token):
        ((_, m, opt),) = _engines(eps, token, 1)
        for _ in range(2):
            F.cross_entropy(m(X[0]), Y[0]).backward()
        with pytest.raises(RuntimeError, match="backward ran twice"):
            opt.step()
        m.engine.close()


def test_every_trainer_saving_at_once_writes_each_step_once(tmp_path: Path) -> None:
    """The documented flow: every trainer calls ``lb.ps.save()`` after its loop, at the same
    step. One checkpoint per server and step, written once, loadable; both calls get the step."""
    from longboat.ps.server import checkpoint

    with servers(2, checkpoint_dir=tmp_path) as (eps, token):
        trainers = _engines(eps, token, 2)
        for i in range(3):
            assert _step(trainers, i) == [None, None]
        for _ in range(3):  # repeated: two saves of one step once raced on the same file
            assert _all(trainers, lambda engine: engine.save()) == [3, 3]
        for index in range(2):
            assert checkpoint.steps_saved(tmp_path, index) == [3]
            assert checkpoint.load(tmp_path, index)["index"] == index
        assert _step(trainers, 3) == [None, None]
        assert _all(trainers, lambda engine: engine.save()) == [4, 4]
        assert checkpoint.steps_saved(tmp_path, 0) == [3, 4]
        for _, m, _ in trainers:
            m.engine.close()
