"""Strategy-selected optimisations through lb.distribute, against single-process references."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from longboat.optim import LAMB, LARS
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
CFG = Config()  # float32 MixedNet


def _cfg(kind: str) -> Config:
    # LAMB normalises like Adam: float64, for the reason given in _workloads.Config.dtype
    return Config(optimizer="adam") if kind == "lamb" else CFG


def _strategies():
    import longboat as lb

    lars = lb.Strategy(lars=True)
    lars.lars_configs = {"lars_coeff": 0.01, "exclude_from_weight_decay": ["bias"]}
    lamb = lb.Strategy(lamb=True)
    lamb.lamb_configs = {"lamb_weight_decay": 0.02}
    local = lb.Strategy(localsgd=True)
    local.localsgd_configs = {"k_steps": 1, "begin_step": 1}
    return {"lars": lars, "lamb": lamb, "localsgd": local}


def _inner_optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "lamb":
        return torch.optim.Adam(model.parameters(), lr=1e-3)
    if kind == "lars":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.SGD(model.parameters(), lr=0.05)  # local SGD: plain SGD


def _train_all(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    import longboat as lb

    lb.init()
    out = {}
    for kind, strategy in _strategies().items():
        x, y = data(_cfg(kind))
        model = build_model(_cfg(kind), seed=rank)
        dmodel, opt = lb.distribute(model, _inner_optimizer(kind, model), strategy)
        for i in range(STEPS):
            opt.zero_grad()
            F.cross_entropy(dmodel(shard(x[i], rank, world)), shard(y[i], rank, world)).backward()
            opt.step()
        out[kind] = params_of(model)
        out[kind + "-type"] = {"name": torch.tensor([ord(c) for c in type(opt.inner).__name__])}
    # the sync BN and fp16-allreduce runs too: one spawn for every test of this file
    out["sync_bn"] = _train_sync_bn(rank, world)
    out["fp16_allreduce"] = _train_fp16_allreduce(rank, world)
    return out


def _reference(kind: str) -> dict[str, torch.Tensor]:
    model = build_model(_cfg(kind), seed=0)
    named = list(model.named_parameters())
    if kind == "lars":
        opt = LARS(named, lr=0.1, momentum=0.9, lars_coeff=0.01, exclude_from_weight_decay=["bias"])
    elif kind == "lamb":
        opt = LAMB(
            named, lr=1e-3, eps=1e-8, lamb_weight_decay=0.02
        )  # Adam's eps, as Fleet carries it
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return train_global_batch(model, opt, _cfg(kind), WORLD)


@pytest.fixture(scope="module")
def results():
    return run_ranks(_train_all, WORLD, timeout=300)


@pytest.mark.parametrize("kind", ["lars", "lamb", "localsgd"])
def test_matches_single_process(results, kind):
    expected = _reference(kind)
    for rank, result in enumerate(results):
        for name, value in expected.items():
            torch.testing.assert_close(
                result[kind][name], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}"
            )


def test_optimizer_was_replaced(results):
    names = {
        k: "".join(map(chr, results[0][k + "-type"]["name"].tolist())) for k in ("lars", "lamb")
    }
    assert names == {"lars": "LARS", "lamb": "LAMB"}


def _bn_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 3),
    )  # fmt: skip


def _bn_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(10, 8, 1, 6, 6, generator=g), torch.randint(0, 3, (10, 8), generator=g)


def _train_sync_bn(rank: int, world: int) -> dict[str, torch.Tensor]:
    import longboat as lb

    model = _bn_model()
    dmodel, opt = lb.distribute(
        model, torch.optim.SGD(model.parameters(), lr=0.1), lb.Strategy(sync_batch_norm=True)
    )
    assert isinstance(model[1], lb.SyncBatchNorm) or isinstance(dmodel.module[1], lb.SyncBatchNorm)
    x, y = _bn_data()
    for i in range(len(x)):
        opt.zero_grad()
        F.cross_entropy(dmodel(shard(x[i], rank, world)), shard(y[i], rank, world)).backward()
        opt.step()
    return {n: t.detach().clone() for n, t in dmodel.module.state_dict().items()}


def test_sync_batch_norm_matches_batch_norm_on_the_global_batch(results):
    results = [r["sync_bn"] for r in results]
    model = _bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _bn_data()
    for i in range(len(x)):
        opt.zero_grad()
        F.cross_entropy(model(x[i]), y[i]).backward()
        opt.step()
    for rank, result in enumerate(results):
        for name, value in model.state_dict().items():
            torch.testing.assert_close(
                result[name], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}"
            )


def _train_fp16_allreduce(rank: int, world: int) -> dict[str, torch.Tensor]:
    import longboat as lb

    model = build_model(CFG, seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dmodel, opt = lb.distribute(model, opt, lb.Strategy(fp16_allreduce=True))
    compressor = dmodel.reducer._fns[0]  # SerialAllreduce around the fp16 compressor
    x, y = data(CFG)
    for i in range(STEPS):
        opt.zero_grad()
        F.cross_entropy(dmodel(shard(x[i], rank, world)), shard(y[i], rank, world)).backward()
        opt.step()
    out = params_of(model)
    out["__bytes__"] = torch.tensor([float(compressor._fn.stats.bytes_sent)])
    return out


def test_fp16_allreduce_trains_like_float32_and_halves_the_bytes(results):
    results = [r["fp16_allreduce"] for r in results]
    model = build_model(CFG, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train_global_batch(model, opt, CFG, WORLD)  # trains `model` in place
    nbytes = sum(p.numel() for p in model.parameters()) * 2  # float16 on the wire
    for result in results:
        assert torch.equal(result["blocks.0.weight"], results[0]["blocks.0.weight"])
        for name, value in model.named_parameters():
            torch.testing.assert_close(result[name], value.detach(), rtol=2e-2, atol=2e-3, msg=name)
        # ring model, 2 ranks: S bytes per step; the bucket also carries one flag per parameter
        assert nbytes * STEPS <= result["__bytes__"].item() < 1.01 * nbytes * STEPS
