"""AMP through lb.distribute: autocast, transparent loss scaling, overflow skipped everywhere."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tests._dist import run_ranks
from tests.collective._workloads import (
    STEPS,
    Config,
    build_model,
    data,
    params_of,
    shard,
    train_global_batch,
)

WORLD = 2
CFG = Config()
OVERFLOW_STEP = 3


def _amp_strategy(dtype: str):
    import longboat as lb

    strategy = lb.Strategy(amp=True)
    strategy.amp_configs = {
        "dtype": dtype,
        "init_loss_scaling": 1024.0,
        "decr_every_n_nan_or_inf": 1,
    }
    return strategy


def _train(rank: int, world: int, dtype: str) -> dict[str, torch.Tensor]:
    import longboat as lb

    lb.init()
    model = build_model(CFG, seed=rank)
    dmodel, opt = lb.distribute(
        model, torch.optim.SGD(model.parameters(), lr=0.05), _amp_strategy(dtype)
    )
    x, y = data(CFG)
    out: dict[str, torch.Tensor] = {}
    for i in range(STEPS):
        xi = shard(x[i], rank, world)
        if dtype == "float16" and i == OVERFLOW_STEP and rank == 1:
            xi = xi.clone()
            xi[0, 0] = float("inf")  # only rank 1 overflows
        opt.zero_grad()
        logits = dmodel(xi)
        out.setdefault("logits_dtype", torch.tensor([str(logits.dtype) == f"torch.{dtype}"]))
        F.cross_entropy(logits.float(), shard(y[i], rank, world)).backward()
        before = params_of(model)
        opt.step()
        moved = any(not torch.equal(before[n], p) for n, p in params_of(model).items())
        out[f"moved{i}"] = torch.tensor([moved])
    out |= params_of(model)
    scaler = dmodel.amp.scaler
    if scaler is not None:
        out["scale"] = torch.tensor([scaler.scale], dtype=torch.float64)
        out["skipped"] = torch.tensor([scaler.skipped_steps])
    return out


def _both(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    """The float16 and the bfloat16 run, one after the other in one spawn."""
    return {dtype: _train(rank, world, dtype) for dtype in ("float16", "bfloat16")}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, dict[str, torch.Tensor]]]:
    return run_ranks(_both, WORLD, timeout=240)


def _reference(skip: int | None) -> dict[str, torch.Tensor]:
    model = build_model(CFG, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return train_global_batch(model, opt, CFG, WORLD, skip=skip)


def test_float16_overflow_on_one_rank_skips_the_step_everywhere(runs):
    results = [r["float16"] for r in runs]
    expected = _reference(skip=OVERFLOW_STEP)
    for rank, r in enumerate(results):
        assert bool(r["logits_dtype"]), "forward did not run under float16 autocast"
        assert not bool(r[f"moved{OVERFLOW_STEP}"]), f"rank {rank} stepped on the overflow"
        assert all(bool(r[f"moved{i}"]) for i in range(STEPS) if i != OVERFLOW_STEP)
        assert r["skipped"].item() == 1
        assert r["scale"].item() == 1024.0 * 0.8  # one overflow shrinks the scale once
        for name, value in expected.items():
            torch.testing.assert_close(r[name], value, rtol=2e-2, atol=2e-3, msg=name)
    assert all(torch.equal(results[0][n], results[1][n]) for n in expected)


def test_bfloat16_trains_like_float32(runs):
    results = [r["bfloat16"] for r in runs]
    expected = _reference(skip=None)
    for r in results:
        assert bool(r["logits_dtype"]) and "scale" not in r  # bf16 needs no loss scaling
        for name, value in expected.items():
            torch.testing.assert_close(r[name], value, rtol=5e-2, atol=5e-3, msg=name)
