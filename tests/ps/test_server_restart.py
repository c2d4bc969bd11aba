"""A parameter server that dies mid-run comes back from its checkpoint and sync trainers recover
by themselves: they roll every server back to the checkpoint step and replay their logged
pushes, so the final parameters equal a run without the failure (single-process training on the
global batch)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from longboat.ps.server import CallError, Server, checkpoint
from longboat.ps.server.state import ServerState
from longboat.ps.shared import wire
from longboat.ps.shared.auth import generate_token
from longboat.ps.shared.request import StaleStep
from longboat.ps.shared.wire import Message
from longboat.ps.trainer.config import PSConfig
from longboat.ps.trainer.recovery import _SERVER_LOST
from tests.collective import _workloads as W
from tests.ps._harness import server_processes
from tests.ps.test_faults import _all, _engines, _step, _steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]  # slow tier: killed and restarted servers


def _reference() -> dict[str, torch.Tensor]:
    cfg = W.Config()
    model = W.build_model(cfg, seed=0)
    return W.train_global_batch(model, W.build_optimizer(cfg, model), cfg, 2)


def _assert_reference(trainers: list[tuple[Any, Any, Any]]) -> None:
    want = _reference()
    for trained, _, _ in trainers:
        for name, p in trained.named_parameters():
            torch.testing.assert_close(p.detach(), want[name], rtol=1e-5, atol=1e-5)


def test_recovery_window_follows_the_checkpoint_period(monkeypatch: pytest.MonkeyPatch) -> None:
    import longboat as lb
    from longboat.ps.trainer import modes

    monkeypatch.setenv("LONGBOAT_PS_CHECKPOINT_EVERY", "3")
    assert PSConfig.from_strategy(lb.Strategy(mode="ps", a_sync=False)).recovery_window == 6
    monkeypatch.delenv("LONGBOAT_PS_CHECKPOINT_EVERY")
    assert PSConfig.from_strategy(lb.Strategy(mode="ps", a_sync=False)).recovery_window == 0
    # whether a trainer replays is its mode's trait: only sync combines every push of a step
    recoverable = {name for name in modes.names() if modes.get(name).recoverable}
    assert recoverable == {"sync"}


def test_sync_trainers_recover_from_a_killed_server_without_losing_updates(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    token = generate_token()
    env = {"LONGBOAT_PS_CHECKPOINT_EVERY": "2"}
    with server_processes(2, token, checkpoint_dir=tmp_path, env=env) as procs:
        trainers = _engines([p.endpoint for p in procs], token, 2, recovery_window=4)
        for i in range(7):
            assert _step(trainers, i) == [None, None]
        _all(trainers, lambda e: e.synchronize())
        procs[1].kill()  # at step 7: its newest checkpoint is step 6
        assert checkpoint.steps_saved(tmp_path, 1)[-1] == 6
        endpoint = procs[1].endpoint
        back = threading.Timer(1.5, procs[1].restart)
        back.start()
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="longboat.ps"):
            assert _steps(trainers, range(7, W.STEPS)) == [None, None]
        back.join()
        assert procs[1].endpoint == endpoint  # the restarted server reuses its endpoint
        assert time.monotonic() - started < 60
        _all(trainers, lambda e: e.synchronize())
        text = caplog.text
        assert f"parameter server 1 ({endpoint}) failed" in text, text
        assert "replayed steps 6..7" in text, text
        assert [t[1].engine.step_no for t in trainers] == [W.STEPS, W.STEPS]
        _assert_reference(trainers)
        _all(trainers, lambda e: e.close())


def test_a_server_killed_before_its_first_periodic_checkpoint_recovers_from_the_initial_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    token = generate_token()
    env = {"LONGBOAT_PS_CHECKPOINT_EVERY": "3"}
    with server_processes(2, token, checkpoint_dir=tmp_path, env=env) as procs:
        trainers = _engines([p.endpoint for p in procs], token, 2, recovery_window=6)
        for i in range(2):
            assert _step(trainers, i) == [None, None]
        _all(trainers, lambda e: e.synchronize())
        assert checkpoint.steps_saved(tmp_path, 1) == [0]  # the initial values, nothing since
        procs[1].kill()  # at step 2, before the first periodic checkpoint (step 3)
        back = threading.Timer(1.0, procs[1].restart)
        back.start()
        with caplog.at_level(logging.WARNING, logger="longboat.ps"):
            assert _steps(trainers, range(2, W.STEPS)) == [None, None]
        back.join()
        _all(trainers, lambda e: e.synchronize())
        assert "replayed steps 0..2" in caplog.text, caplog.text
        _assert_reference(trainers)
        _all(trainers, lambda e: e.close())


_TABLE = {"name": "t", "rows": 10, "dim": 2, "optimizer": "sgd", "hparams": {"lr": 0.1}}


def _push(state: ServerState, trainer: int, step: int) -> None:
    ids = torch.tensor([trainer, 2 + trainer])
    grads = {"w": torch.ones(3), "t@ids": ids, "t@grad": torch.ones(2, 2)}
    state.push(Message({"trainer": trainer, "step": step, "lrs": [0.1]}, grads))


def _pull(step: int, trainer: int = 0) -> bytes:
    meta = {"keys": ["w"], "version": step, "trainer": trainer}
    return wire.encode(Message(meta, {"t@ids": torch.tensor([0, 1])}))


def _job_at_step_2(tmp_path: Path) -> ServerState:
    """One server of a 2-trainer sync job (a dense block, a table) at step 2, checkpointed."""
    state = ServerState(0, 1)
    block = {"key": "w", "update": "optimizer", "optimizer": "sgd", "hparams": {"lr": 0.1}}
    init = {"trainers": 2, "sync": True, "blocks": [block], "tables": [_TABLE]}
    state.init(Message(init, {"w": torch.zeros(3)}))
    for step in range(2):
        for trainer in range(2):
            _push(state, trainer, step)
    checkpoint.save_streaming(tmp_path, 0, 2, state)
    return state


def test_a_restarted_server_refuses_at_once_a_pull_of_a_step_it_lost(tmp_path: Path) -> None:
    """The job went on to step 4 before the server died; restarted from step 2, it answers the
    trainers' pulls of steps 3 and 4 (whose pushes it lost) with FAILED_PRECONDITION at once,
    a code the trainers' recovery handles, where it used to wait until the call's deadline."""
    _job_at_step_2(tmp_path)
    server = Server(index=0, num_servers=1, token=generate_token(), checkpoint_dir=tmp_path)
    try:
        assert server.restored_step == 2
        for step in (3, 4):
            with pytest.raises(CallError) as info:
                server.answer("pull", _pull(step), time.monotonic() + 600)
            assert info.value.code.name == "FAILED_PRECONDITION", info.value.details
            assert "never received trainer 0's push of step" in info.value.details
            assert info.value.code.name in _SERVER_LOST
        # a trainer that pushed step 2 waits for the others' pushes (here: until a deadline
        # that has passed), as before
        _push(server.state, 0, 2)
        with pytest.raises(CallError) as info:
            server.answer("pull", _pull(3), time.monotonic())
        assert info.value.code.name == "DEADLINE_EXCEEDED"
        with pytest.raises(CallError) as info:  # the other trainer did not push step 2
            server.answer("pull", _pull(3, trainer=1), time.monotonic() + 600)
        assert info.value.code.name == "FAILED_PRECONDITION"
    finally:
        server.stop(0)


def test_a_pull_waiting_when_a_rollback_begins_is_refused(tmp_path: Path) -> None:
    """Trainer 0 pushed step 2 and waits for trainer 1, which starts rolling the servers back
    instead: the waiting pull is refused (it would wait for a push that never comes)."""
    state = _job_at_step_2(tmp_path)
    _push(state, 0, 2)
    outcome: list[BaseException] = []

    def pull() -> None:
        try:
            state.pull(wire.decode(_pull(3)), time.monotonic() + 600)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    waiting = threading.Thread(target=pull)
    waiting.start()
    while not state.roster.busy.get(0):  # the pull is in (it holds the trainer's call count)
        time.sleep(0.01)
    state.begin_rollback()
    waiting.join(60)
    assert len(outcome) == 1 and isinstance(outcome[0], StaleStep), outcome
    assert "rolling back" in str(outcome[0])
