"""A mode registered outside longboat (tests/ps/_counting_mode.py) is selected through
``PSConfig.mode`` (``lb.ps.distribute(..., mode=name)``) and trains on real servers; built-in
modes are registered by name; ``lb.shutdown()`` closes and forgets the current engine."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import longboat as lb
from longboat.ps.trainer import modes
from longboat.ps.trainer.config import PSConfig
from tests.ps import _counting_mode
from tests.ps._harness import servers

TRAINERS, STEPS = 2, 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 8, generator=gen), torch.randint(0, 2, (4,), generator=gen)


def _train(eps: list[str], token: str, **overrides: Any) -> list[tuple[Any, list[torch.Tensor]]]:
    """STEPS sync steps of TRAINERS trainers (threads); each trainer's mode and parameters."""

    models = [_model() for _ in range(TRAINERS)]  # here: torch's seed is global to the threads

    def connect(rank: int) -> tuple[Any, Any]:
        model = models[rank]
        strategy = lb.Strategy(mode="ps", a_sync=False)
        return lb.ps.distribute(
            model, torch.optim.SGD(model.parameters(), lr=0.1), strategy,
            servers=eps, trainer=rank, trainers=TRAINERS, token=token, **overrides,
        )  # fmt: skip

    def run(rank: int) -> tuple[Any, list[torch.Tensor]]:
        m, opt = trainers[rank]
        for step in range(STEPS):
            x, y = _batch(rank, step)
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
        m.engine.close()
        return m.engine.mode, [p.detach().clone() for p in m.module.parameters()]

    with ThreadPoolExecutor(TRAINERS) as pool:
        trainers = list(pool.map(connect, range(TRAINERS)))
        return list(pool.map(run, range(TRAINERS)))


def _reference() -> list[torch.Tensor]:
    """Single-process SGD on the global batch (what sync training equals)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        batches = [_batch(rank, step) for rank in range(TRAINERS)]
        opt.zero_grad()
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def test_builtin_modes_are_registered() -> None:
    assert set(modes.names()) >= {"sync", "async", "half_async", "geo"}
    assert PSConfig.from_strategy(lb.Strategy(mode="ps"), mode="geo").mode == "geo"


def test_registered_mode_is_selected_and_trains() -> None:
    with _counting_mode.registered() as counting:
        assert _counting_mode.NAME in modes.names()
        with servers(2) as (eps, token):
            results = _train(eps, token, mode=_counting_mode.NAME)
    assert _counting_mode.NAME not in modes.names()  # unregistered again
    expected = _reference()
    for mode, params in results:
        assert type(mode) is counting
        assert mode.steps == STEPS
        for got, want in zip(params, expected, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_unknown_mode_names_the_registered_ones() -> None:
    with pytest.raises(ValueError, match="unknown parameter-server mode 'nope'.*sync"):
        _train(["127.0.0.1:1"], "token", mode="nope")


def test_shutdown_closes_and_forgets_the_current_engine() -> None:
    with servers(1) as (eps, token):
        for close_first in (True, False):
            model = _model()
            m, _ = lb.ps.distribute(
                model, torch.optim.SGD(model.parameters(), lr=0.1),
                lb.Strategy(mode="ps", a_sync=False), servers=eps, trainer=0, trainers=1,
                token=token,
            )  # fmt: skip
            assert lb.ps.current() is m.engine
            if close_first:
                m.engine.close()
            lb.shutdown()
            lb.shutdown()  # again: nothing left to do
            assert m.engine.closed
            m.engine.close()  # closing twice is harmless
            with pytest.raises(RuntimeError, match="no parameter-server engine"):
                lb.ps.current()
