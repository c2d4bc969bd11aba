"""Reducer and engine rules that only matter on N GPUs, checked in one process on CPU."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from longboat.collective import engine
from longboat.collective import reducer as reducer_module
from longboat.collective.buckets import BucketPlan
from longboat.collective.reducer import Reducer, UnusedParametersError
from longboat.comm import exchange
from longboat.comm.algorithms import Done


def _doubled(tensor: torch.Tensor) -> Done:
    """Two ranks holding the same tensor: the sum is twice it (complete at once)."""
    tensor.mul_(2)
    return Done()


class _SlowCounts:
    """A PendingCounts whose copy lands only when the test says so."""

    made: list[_SlowCounts] = []
    script: list[list[int]] = []

    def __init__(self, flags: torch.Tensor):
        self._counts = _SlowCounts.script.pop(0)
        self.landed = False
        _SlowCounts.made.append(self)

    def ready(self) -> bool:
        return self.landed

    def counts(self) -> list[int]:
        return self._counts


def test_counts_still_in_flight_are_checked_later_never_dropped(monkeypatch: pytest.MonkeyPatch):
    """A host running ahead of its GPU: the counts of step 1 (another rank missed ``0.bias``) have
    not landed by step 2 and step 2's have (every rank used everything); both are checked, in order, once landed."""
    monkeypatch.setattr(reducer_module, "PendingCounts", _SlowCounts)
    _SlowCounts.made, _SlowCounts.script = [], [[2, 1, 2, 2], [2, 2, 2, 2]]
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    named = [(n, p) for n, p in model.named_parameters()]
    plan = BucketPlan((tuple(range(len(named))),), 1 << 20, 20, fused=True)
    reducer = Reducer(named, plan, [_doubled], world_size=2)
    reducer._reads_block = True  # as on a GPU: counts come back without a host wait

    def step() -> None:
        reducer.prepare(sync=True, divisor=2.0)
        model(torch.ones(1, 3)).sum().backward()

    step()  # step 1's counts: still on their way
    step()  # step 1's not landed at prepare; step 2's queued behind them
    first, second = _SlowCounts.made
    second.landed = True
    reducer.prepare(sync=True, divisor=2.0)  # the oldest has not landed: nothing read out of order
    first.landed = True
    with pytest.raises(UnusedParametersError, match="no gradient on 1 of 2 ranks"):
        reducer.prepare(sync=True, divisor=2.0)


def test_control_device_follows_the_group_then_the_model(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(exchange.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(exchange, "_bound_device", None)
    bound = SimpleNamespace(bound_device_id=torch.device("cuda", 3))
    assert exchange.control_device(bound) == torch.device("cuda", 3)  # type: ignore[arg-type]
    exchange.bind_device(torch.device("cuda", 1))
    unbound = SimpleNamespace(bound_device_id=None)
    assert exchange.control_device(unbound) == torch.device("cuda", 1)  # type: ignore[arg-type]
    exchange.bind_device(torch.device("cpu"))  # a CPU model binds nothing
    monkeypatch.setattr(exchange.torch.cuda, "current_device", lambda: 2)
    assert exchange.control_device(unbound) == torch.device("cuda", 2)  # type: ignore[arg-type]


def test_control_device_is_the_cpu_under_a_host_backend(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(exchange.dist, "get_backend", lambda group=None: "gloo")
    assert exchange.control_device(None) == torch.device("cpu")


def _plan(**fields: object) -> SimpleNamespace:
    base = {
        "sync_batch_norm": True,
        "find_unused_parameters": False,
        "comm": SimpleNamespace(algorithm="native"),
        "compression": SimpleNamespace(name="none"),
    }
    return SimpleNamespace(**{**base, **fields})


@pytest.mark.parametrize(
    ("backend", "fields", "threaded", "warned"),
    [
        ("nccl", {}, False, None),
        ("nccl", {"find_unused_parameters": True}, False, "different branches"),
        ("nccl", {}, True, "worker thread"),
        ("gloo", {"find_unused_parameters": True}, True, None),
        ("nccl", {"sync_batch_norm": False, "find_unused_parameters": True}, True, None),
    ],
)
def test_sync_bn_order_warning(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    backend: str,
    fields: dict,
    threaded: bool,
    warned: str | None,
):
    monkeypatch.setattr(engine.dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(engine.cluster, "rank", lambda: 0)
    fns: list = [_doubled]
    if threaded:
        fns.append(engine.AsyncAllreduce(lambda t: None, "test"))
    try:
        with caplog.at_level(logging.WARNING, logger="longboat.collective"):
            engine._warn_if_sync_bn_order_may_differ(_plan(**fields), fns)  # type: ignore[arg-type]
    finally:
        for fn in fns[1:]:
            fn.close()
    text = " ".join(r.getMessage() for r in caplog.records)
    if warned is None:
        assert "sync BN" not in text
    else:
        assert warned in text and "deadlock" in text
