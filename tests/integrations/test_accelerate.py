"""Hugging Face ``accelerate`` with longboat's DDP communication hook: 2 spawned CPU ranks
train a model prepared by ``Accelerator`` equal to one process on the global batch, with and
without the hook (exact algorithms), and within compression error for bf16."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("accelerate")

from tests._dist import run_ranks  # noqa: E402

WORLD, PER_RANK, STEPS = 2, 8, 5
# name -> Strategy fields for lb.ddp_comm_hook (None: accelerate's DDP without a hook)
CASES: dict[str, dict[str, Any] | None] = {
    "no hook": None,
    "default": {},
    "ring": {"allreduce_algorithm": "ring"},
    "bf16": {"gradient_compression": "bf16"},
}
TOLERANCE = {"bf16": 5e-3}


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    n = WORLD * PER_RANK * STEPS
    return TensorDataset(torch.randn(n, 10, generator=g), torch.randint(0, 3, (n,), generator=g))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3)
    )


def _train_all(_rank: int, _world: int) -> dict[str, Any]:
    from accelerate import Accelerator

    import longboat as lb

    accelerator = Accelerator(cpu=True)
    results: dict[str, Any] = {"distributed_type": str(accelerator.distributed_type)}
    for name, fields in CASES.items():
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        loader = DataLoader(_data(), batch_size=PER_RANK)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        if fields is not None:
            model.register_comm_hook(*lb.ddp_comm_hook(lb.Strategy(**fields)))
        for x, y in loader:
            optimizer.zero_grad()
            accelerator.backward(F.cross_entropy(model(x), y))
            optimizer.step()
        results[name] = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
    return results


def _reference() -> list[torch.Tensor]:
    """One process, batches of WORLD * PER_RANK: accelerate hands rank r the r-th batch of
    each group of WORLD consecutive batches."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in DataLoader(_data(), batch_size=WORLD * PER_RANK):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_train_all, WORLD, timeout=180)


@pytest.mark.parametrize("name", list(CASES))
def test_accelerate_with_the_hook_equals_one_process(ranks, name: str) -> None:
    assert ranks[0]["distributed_type"] == "DistributedType.MULTI_CPU"
    expected = _reference()
    for rank in ranks:
        for e, g in zip(expected, rank[name], strict=True):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=TOLERANCE.get(name, 1e-6))
    for a, b in zip(ranks[0][name], ranks[1][name], strict=True):
        assert torch.equal(a, b)
