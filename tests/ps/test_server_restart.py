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

from longboat.ps import checkpoint
from longboat.ps.auth import generate_token
from longboat.ps.config import PSConfig
from tests.collective import _workloads as W
from tests.ps._harness import server_processes
from tests.ps.test_faults import _all, _engines, _step

pytestmark = pytest.mark.timeout(120)


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

    monkeypatch.setenv("LONGBOAT_PS_CHECKPOINT_EVERY", "3")
    assert PSConfig.from_strategy(lb.Strategy(mode="ps", a_sync=False)).recovery_window == 6
    assert PSConfig.from_strategy(lb.Strategy(mode="ps", a_sync=True)).recovery_window == 0
    monkeypatch.delenv("LONGBOAT_PS_CHECKPOINT_EVERY")
    assert PSConfig.from_strategy(lb.Strategy(mode="ps", a_sync=False)).recovery_window == 0


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
            for i in range(7, W.STEPS):
                assert _step(trainers, i) == [None, None]
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
