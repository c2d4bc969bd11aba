"""Async, half-async and geo train the demo task (digits) to within 2 points of sync."""

from __future__ import annotations

import contextlib

import pytest
import torch

import longboat as lb
from longboat.ps.trainer.engine import PSConfig
from tests._dist import run_ranks
from tests.ps import _trainers as T
from tests.ps._harness import servers

MODES = {
    "sync": {"a_sync": False},
    "async": {"a_sync": True, "a_sync_configs": {"k_steps": 0, "send_queue_size": 1}},
    "half_async": {"a_sync": True, "use_thread_barrier": True},
    "geo": {"a_sync": True, "a_sync_configs": {"k_steps": 4}},
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_strategy_selects_mode(mode: str) -> None:
    assert PSConfig.from_strategy(lb.Strategy(mode="ps", **MODES[mode])).mode == mode


def test_sync_with_geo_k_steps_is_refused_with_fix() -> None:
    s = lb.Strategy(mode="ps", a_sync=False, a_sync_configs={"k_steps": 3})
    with pytest.raises(ValueError, match="set a_sync=True for geo or k_steps=0 for sync"):
        PSConfig.from_strategy(s)


def _sync_accuracy(epochs: int) -> float:
    """Sync mode's accuracy: sync equals single-process training on the global batch
    (test_sync.py proves it), so the reference stands in for it without any RPC."""
    from longboat.tools import demo_train as D

    cfg = T.digits_config(2, epochs)
    train, test = D.load_digits_split()
    model = D.build_model(cfg.seed)
    optimizer = D.build_optimizer(model, cfg)
    x, y = train.tensors
    for epoch in range(epochs):
        for batch in D.global_batches(train, cfg, epoch):
            idx = torch.tensor(batch)
            D.train_step(model, optimizer, x[idx], y[idx])
    return D.accuracy(model, test)


@pytest.mark.slow  # a whole end-to-end run: the slow tier (CI runs it after the quick one)
def test_async_modes_reach_sync_accuracy() -> None:
    epochs = 8
    modes = [m for m in MODES if m != "sync"]
    with contextlib.ExitStack() as stack:
        jobs = [(*stack.enter_context(servers(2)), MODES[m], epochs) for m in modes]
        per_rank = run_ranks(T.run_each, 2, "train_digits", jobs, timeout=150)
    acc = dict(zip(modes, per_rank[0], strict=True)) | {"sync": _sync_accuracy(epochs)}
    print("test accuracy per mode:", acc)
    assert acc["sync"] > 0.85, acc  # the task is learnt at all
    for mode in modes:
        # asynchronous pushes are stale by an amount that depends on how busy the machine is
        # (seen: 0.02-0.04 below sync under a loaded full suite); far below means not learnt
        assert acc[mode] >= acc["sync"] - 0.05, (mode, acc)
