"""A parameter-server mode is one file end to end: the Strategy selects any registered mode by
name (a near miss named), and ``longboat sim`` prices it by the cost it declares, never by its
name; a mode without one is refused, named."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest

from longboat.ps.trainer import modes
from longboat.ps.trainer.config import PSConfig
from longboat.sim import cluster as cluster_mod
from longboat.sim.predict import simulate
from longboat.strategy import Strategy, StrategyError
from tests.sim.helpers import linear_profile

CLUSTER = cluster_mod.from_dict(
    {
        "nodes": 2,
        "devices_per_node": 2,
        "inter": {"bandwidth": "10gbit"},
        "ps": {"servers": 2, "bandwidth": "10gbit"},
    }
)
PROFILE = linear_profile([1024] * 5)


@pytest.fixture
def toy() -> Iterator[ModuleType]:
    module = importlib.import_module("tests.ps._toy_mode")
    try:
        yield module
    finally:
        modes.unregister(module.NAME)
        sys.modules.pop(module.__name__, None)


def test_every_builtin_mode_declares_a_cost() -> None:
    assert all(modes.get(name).cost is not None for name in modes.names())


def test_the_strategy_selects_a_mode_of_ones_own_and_sim_prices_it(toy: ModuleType) -> None:
    strategy = Strategy(mode="ps", a_sync_configs={"mode": toy.NAME})
    assert PSConfig.from_strategy(strategy).mode == toy.NAME
    eager = simulate(PROFILE, CLUSTER, strategy)
    sync = simulate(PROFILE, CLUSTER, Strategy(mode="ps", a_sync=False))
    assert eager.algorithm == f"ps {toy.NAME}, 2 server(s)"
    assert eager.exposed_comm_s > sync.exposed_comm_s  # two waited calls instead of one
    assert eager.step_s - sync.step_s == pytest.approx(eager.exposed_comm_s - sync.exposed_comm_s)


def test_a_builtin_mode_by_name_equals_its_flags() -> None:
    by_name = Strategy(mode="ps", a_sync_configs={"mode": "half_async"})
    by_flags = Strategy(mode="ps", use_thread_barrier=True)
    assert simulate(PROFILE, CLUSTER, by_name) == simulate(PROFILE, CLUSTER, by_flags)


def test_a_typo_is_named_with_the_nearest_mode() -> None:
    with pytest.raises(StrategyError, match="did you mean 'half_async'"):
        Strategy(mode="ps", a_sync_configs={"mode": "half_asnyc"})


def test_a_mode_without_a_cost_is_refused_by_name(toy: ModuleType) -> None:
    @modes.register("toy_unpriced")
    class Unpriced(toy.ToyEager):
        cost = None

    try:
        strategy = Strategy(mode="ps", a_sync_configs={"mode": "toy_unpriced"})
        with pytest.raises(ValueError, match="mode 'toy_unpriced' declares no cost"):
            simulate(PROFILE, CLUSTER, strategy)
    finally:
        modes.unregister("toy_unpriced")
