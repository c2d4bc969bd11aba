"""Sharding stage 3 at 4 ranks equals one process, and a sharded checkpoint saved at 4 ranks
loads at 2 (training goes on equal to one process) and at 1 (slow tier)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests._dist import run_ranks
from tests.sharding import _lm
from tests.sharding import test_stage3 as two

pytestmark = pytest.mark.slow

CASES_AT_4 = ["adamw_block_units", "clip", "merge", "hsdp_2x2"]
two.CASES.setdefault("hsdp_2x2", {"opt": "adamw", "configs": {"sharding_degree": 2}})


def _at_4(rank: int, world: int, directory: str) -> dict[str, Any]:
    import longboat as lb

    lb.init(backend="gloo")
    return {name: two._case(name, rank, world, directory) for name in CASES_AT_4}


def _resume(rank: int, world: int, load_from: str, save_to: str) -> dict[str, Any]:
    """Load the 3-step checkpoint, train the 4th step, save; (1 rank: load the 4-step one)."""
    import longboat as lb

    lb.init(backend="gloo")
    net = _lm.model(seed=7)  # other weights: the checkpoint must replace them
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    strategy = lb.Strategy(sharding=True, sharding_configs={"stage": 3})
    model, opt = lb.distribute(net, optimizer, strategy)
    state = lb.load_sharded_checkpoint(load_from, opt)
    if save_to:
        tokens, targets = _lm.batches(two.STEPS + 1, two.BATCH)[-1]
        x, y = _lm.part(tokens, rank, world), _lm.part(targets, rank, world)
        _lm.loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        lb.save_sharded_checkpoint(save_to, opt, {"step": state["step"] + 1})
    return {"state": state, "model": model.state_dict(), "optimizer": opt.state_dict()}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    base = tmp_path_factory.mktemp("stage3-slow")
    return str(base / "at4"), str(base / "at2")


@pytest.fixture(scope="module")
def at_4(dirs: tuple[str, str]) -> list[dict[str, Any]]:
    return run_ranks(_at_4, 4, dirs[0], timeout=400)


@pytest.mark.parametrize("name", CASES_AT_4)
def test_stage3_at_4_ranks_equals_one_process(at_4: list[dict[str, Any]], name: str) -> None:
    for rank in at_4:
        two._check(rank[name], name)


def test_checkpoint_saved_at_4_loads_at_2_and_at_1(
    at_4: list[dict[str, Any]], dirs: tuple[str, str]
) -> None:
    at_2 = run_ranks(_resume, 2, dirs[0], dirs[1], timeout=300)
    (at_1,) = run_ranks(_resume, 1, dirs[1], "", timeout=300)
    net = _lm.model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    _lm.train(net, optimizer, _lm.batches(two.STEPS + 1, two.BATCH))
    ref = {"model": net, "optimizer": optimizer, "norms": []}
    assert at_2[0]["state"] == {"step": two.STEPS - 1}
    assert at_1["state"] == {"step": two.STEPS}
    for got in (*at_2, at_1):
        got = {**got, "norms": []}
        two.check_against(got, ref)
