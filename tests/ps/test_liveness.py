"""Sync mode when a trainer dies: servers drop a silent trainer after the trainer timeout, the
step completes with the live trainers, and the trainer (restarted or resuming) rejoins."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import longboat as lb
from longboat.ps.server.limits import TRAINER_TIMEOUT_ENV, ServerLimits
from longboat.ps.server.state import ServerState
from longboat.ps.shared.request import DROPPED, Dropped
from longboat.ps.shared.wire import Message
from tests.collective import _workloads as W
from tests.ps._harness import servers

TRAINER = Path(__file__).with_name("_liveness_trainer.py")
WAIT_S = 120.0  # the bound of every wait below (reached only when something is broken)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _state(trainers: int, clock: Clock) -> ServerState:
    """One server of ``trainers`` sync trainers holding block "k" (value := the mean push)."""
    state = ServerState(0, 1, trainer_timeout=2.0, clock=clock)
    spec = {"key": "k", "update": "assign"}
    state.init(
        Message({"trainers": trainers, "sync": True, "blocks": [spec]}, {"k": torch.zeros(2)})
    )
    for t in range(trainers):
        state.join(Message({"trainer": t, "step": 0}))
    return state


def _push(state: ServerState, trainer: int, step: int, value: float) -> None:
    state.push(Message({"trainer": trainer, "step": step}, {"k": torch.full((2,), value)}))


def test_setting_comes_from_the_environment() -> None:
    assert ServerLimits().trainer_timeout_s == 60.0
    assert ServerLimits.from_env({TRAINER_TIMEOUT_ENV: "2.5"}).trainer_timeout_s == 2.5
    with pytest.raises(ValueError, match=TRAINER_TIMEOUT_ENV):
        ServerLimits(trainer_timeout_s=0)


def test_silent_trainer_is_dropped_and_its_stale_pushes_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    state = _state(3, clock)
    _push(state, 0, 0, 2.0)
    _push(state, 2, 0, 4.0)
    clock.now = 1.0
    assert state.drop_silent() == []  # not silent long enough
    assert torch.equal(state.blocks["k"].value, torch.zeros(2))
    clock.now = 2.5
    with caplog.at_level(logging.WARNING, logger="longboat.ps"):
        assert state.drop_silent() == [1]
    assert "dropped trainer 1: silent for 2.5 s" in caplog.text
    assert "its last step: none" in caplog.text
    assert torch.equal(state.blocks["k"].value, torch.full((2,), 3.0))  # mean of 0 and 2
    with pytest.raises(Dropped, match=f"trainer 1's push of step 0 is refused.*{DROPPED}"):
        _push(state, 1, 0, 100.0)
    _push(state, 0, 1, 1.0)
    _push(state, 2, 1, 5.0)  # step 1 does not wait for trainer 1
    assert state.blocks["k"].version == 2
    assert state.missing({"keys": ["k"], "version": 3}) == [0, 2]  # not the dropped one
    # trainer 1 comes back asking for step 1: the servers are at 2, it is expected from 2 on
    reply = state.join(Message({"trainer": 1, "step": 1}))
    assert reply.meta["step"] == 2 and reply.meta["rejoined"]
    with pytest.raises(Dropped, match="rejoined from step 2"):
        _push(state, 1, 1, 100.0)  # a stale push of a finished step: never applied
    _push(state, 0, 2, 3.0)
    _push(state, 2, 2, 3.0)
    assert state.blocks["k"].version == 2  # waits for trainer 1 again
    assert state.missing({"keys": ["k"], "version": 3}) == [1]
    _push(state, 1, 2, 6.0)
    assert state.blocks["k"].version == 3
    assert torch.equal(state.blocks["k"].value, torch.full((2,), 4.0))  # (3 + 3 + 6) / 3


def test_barrier_stops_waiting_for_a_dropped_trainer() -> None:
    clock = Clock()
    state = _state(2, clock)
    errors: list[BaseException] = []

    def arrive(gen: int) -> None:
        try:
            msg = Message({"trainer": 0, "name": "", "generation": gen})
            state.barrier(msg, time.monotonic() + WAIT_S)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    waiter = threading.Thread(target=arrive, args=(1,))
    waiter.start()
    deadline = time.monotonic() + WAIT_S
    while ("", 1) not in state.barriers.arrived and time.monotonic() < deadline:
        time.sleep(0.01)
    clock.now = 10.0  # trainer 0 is in a call, so never silent
    assert state.drop_silent() == [1]
    waiter.join(WAIT_S)
    assert not waiter.is_alive() and not errors
    arrive(2)  # later barriers do not wait for it
    assert not errors
    assert state.join(Message({"trainer": 1, "step": 0})).meta["barrier"] == 2


def _engines(eps: list[str], token: str, world: int) -> list[tuple[Any, Any, Any]]:
    """``world`` sync trainers (threads of this process) on the servers ``eps``."""
    cfg = W.Config()
    models = [W.build_model(cfg, seed=0) for _ in range(world)]  # global RNG: not in threads

    def make(rank: int) -> tuple[Any, Any, Any]:
        m, opt = lb.ps.distribute(
            models[rank],
            W.build_optimizer(cfg, models[rank]),
            lb.Strategy(mode="ps", a_sync=False),
            servers=eps,
            trainer=rank,
            trainers=world,
            token=token,
            timeout=30,
        )
        return models[rank], m, opt

    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(make, range(world)))


def _steps(trainers: list[tuple[Any, Any, Any]], ranks: list[int], world: int) -> None:
    """One step of each trainer in ``ranks``, at once."""
    x, y = W.data(W.Config())

    def one(rank: int) -> None:
        _, m, opt = trainers[rank]
        i = m.engine.step_no % W.STEPS
        opt.zero_grad()
        F.cross_entropy(m(W.shard(x[i], rank, world)), W.shard(y[i], rank, world)).backward()
        opt.step()

    with ThreadPoolExecutor(len(ranks)) as pool:
        list(pool.map(one, ranks))


def test_resuming_trainer_is_refused_then_rejoins(caplog: pytest.LogCaptureFixture) -> None:
    limits = ServerLimits(trainer_timeout_s=2.0)
    with servers(2, limits=limits) as (eps, token), caplog.at_level(logging.INFO, "longboat"):
        trainers = _engines(eps, token, 2)
        try:
            for _ in range(2):
                _steps(trainers, [0, 1], 2)
            for _ in range(3):  # trainer 1 is silent: the servers drop it, trainer 0 goes on
                _steps(trainers, [0], 2)
            engines = [m.engine for _, m, _ in trainers]
            engines[0].synchronize()
            assert engines[0].step_no == 5 and engines[1].step_no == 2
            _steps(trainers, [1], 2)  # its push of step 2 is refused: it rejoins at step 5
            assert engines[1].step_no == 5
            for _ in range(3):
                _steps(trainers, [0, 1], 2)
            for e in engines:
                e.synchronize()
            assert [e.step_no for e in engines] == [8, 8]
            got = [W.params_of(model) for model, _, _ in trainers]
            for name, value in got[0].items():
                assert torch.equal(value, got[1][name]), name
        finally:
            for _, m, _ in trainers:
                m.engine.close()
    assert "dropped trainer 1" in caplog.text
    assert "trainer 1's push of step 2 is refused" in caplog.text
    assert "trainer 1 rejoined at step 5" in caplog.text


@contextlib.contextmanager
def _trainer_procs() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """``start(*args)`` runs ``_liveness_trainer.py``; every process is killed at exit."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(*args: str, token: str, log: Path) -> subprocess.Popen[bytes]:
        env = {**os.environ, "LONGBOAT_PS_TOKEN": token}
        with log.open("ab") as out:
            proc = subprocess.Popen([sys.executable, str(TRAINER), *args], env=env,
                                    stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        procs.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


def _shown(logs: list[Path]) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in logs)


def _wait_for(what: str, ready: Callable[[], bool], logs: Callable[[], list[Path]]) -> None:
    """Poll ``ready`` (bounded by WAIT_S); fail with the logs if it never is."""
    deadline = time.monotonic() + WAIT_S
    while not ready():
        if time.monotonic() > deadline:
            pytest.fail(f"never saw {what}\n{_shown(logs())}")
        time.sleep(0.05)


def _progress(folder: Path, name: str) -> int:
    try:
        return int((folder / f"{name}.progress").read_text())
    except (FileNotFoundError, ValueError):
        return -1


def _finish(proc: subprocess.Popen[bytes], logs: Callable[[], list[Path]]) -> None:
    """Wait (bounded) for a trainer process; fail with the logs unless it ended with 0."""
    try:
        code = proc.wait(WAIT_S)
    except subprocess.TimeoutExpired:
        code = None
    if code != 0:
        pytest.fail(f"trainer {proc.args[2:]} ended with {code}\n{_shown(logs())}")


Start = Callable[..., subprocess.Popen[bytes]]


@contextlib.contextmanager
def _job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Start]:
    """Two servers (threads here; trainer timeout 2 s, from the environment); yields
    ``trainer(rank, name, *args)``, starting a trainer process logging to ``tmp_path``. Every
    process is killed at exit."""
    monkeypatch.setenv(TRAINER_TIMEOUT_ENV, "2")
    with servers(2) as (eps, token), _trainer_procs() as start:

        def trainer(rank: int, name: str, *extra: str) -> subprocess.Popen[bytes]:
            args = (",".join(eps), str(rank), "2", str(tmp_path), name, *extra)
            return start(*args, token=token, log=tmp_path / f"{name}.log")

        yield trainer


def _drops(caplog: pytest.LogCaptureFixture, trainer: int) -> list[str]:
    """The servers' warnings dropping ``trainer``."""
    return [
        r.getMessage()
        for r in list(caplog.records)
        if r.levelno == logging.WARNING and f"dropped trainer {trainer}:" in r.getMessage()
    ]


def test_killed_trainer_is_dropped_and_the_other_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "target").write_text("12")
    logs = lambda: sorted(tmp_path.glob("*.log"))  # noqa: E731
    with _job(tmp_path, monkeypatch) as trainer, caplog.at_level(logging.INFO, "longboat"):
        t0 = trainer(0, "t0")
        t1 = trainer(1, "t1", "--hold-after", "3")
        _wait_for("trainer 1 at step 3", lambda: _progress(tmp_path, "t1") == 3, logs)
        os.kill(t1.pid, signal.SIGKILL)
        _finish(t0, logs)  # no hang: it trains on alone
    assert _progress(tmp_path, "t0") == 12
    drops = _drops(caplog, 1)
    assert {d.split(":")[0] for d in drops} == {"server 0", "server 1"}, caplog.text
    for text in drops:
        assert f"longer than {TRAINER_TIMEOUT_ENV}=2 s" in text and "its last step: " in text
    assert not _drops(caplog, 0)


@pytest.mark.slow  # slow tier: a trainer killed and restarted
def test_restarted_trainer_rejoins_and_both_end_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    logs = lambda: sorted(tmp_path.glob("*.log"))  # noqa: E731
    with _job(tmp_path, monkeypatch) as trainer, caplog.at_level(logging.INFO, "longboat"):
        t0 = trainer(0, "t0")
        t1 = trainer(1, "t1", "--hold-after", "3")
        _wait_for("trainer 1 at step 3", lambda: _progress(tmp_path, "t1") == 3, logs)
        os.kill(t1.pid, signal.SIGKILL)
        _wait_for("both servers dropping trainer 1", lambda: len(_drops(caplog, 1)) >= 2, logs)
        again = trainer(1, "t1b")  # a new process with the same index
        _wait_for("trainer 1 rejoining", lambda: _progress(tmp_path, "t1b") > 0, logs)
        last = max(_progress(tmp_path, "t0"), _progress(tmp_path, "t1b"))
        (tmp_path / "target").write_text(str(last + 10))  # both end at the same step
        _finish(t0, logs)
        _finish(again, logs)
    assert _progress(tmp_path, "t0") == _progress(tmp_path, "t1b") == last + 10
    rejoins = [r.getMessage() for r in caplog.records if "trainer 1 rejoins" in r.getMessage()]
    assert {m.split(":")[0] for m in rejoins} == {"server 0", "server 1"}, caplog.text
    first, second = (torch.load(tmp_path / f"{n}.pt") for n in ("t0", "t1b"))
    assert first.keys() == second.keys()
    for name, value in first.items():
        assert torch.equal(value, second[name]), name
