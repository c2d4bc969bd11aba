"""Multi-process training equals single-process training on the global batch, and DDP."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

from tests._dist import run_ranks
from tests.collective._workloads import (
    STEPS,
    Config,
    build_model,
    build_optimizer,
    data,
    params_of,
    reference,
    shard,
)

GRID = [
    Config(optimizer=o, cap_mb=c, comms=n, k_steps=k)
    for o, c, n, k in itertools.product(("sgd", "adam"), (0.001, 1.0, 32.0), (1, 3), (1, 4))
]
EXTRA = [
    Config(optimizer="sgd", unused="always"),
    Config(optimizer="adam", unused="partial", comms=3, cap_mb=0.001),
    Config(optimizer="sgd", unused="partial", k_steps=4),
    Config(optimizer="adam", comms=3, sync_each_comm=False, cap_mb=0.001),
    Config(optimizer="sgd", fuse=False),
    Config(optimizer="sgd", k_steps=4, set_to_none=False, cap_mb=0.001),
    Config(optimizer="adam", comms=3, set_to_none=False),
    *(
        Config(optimizer=o, algorithm=a, cap_mb=c, comms=n)
        for a in ("ring", "shm", "hierarchical", "auto")
        for o, c, n in (("sgd", 0.001, 1), ("adam", 1.0, 2))
    ),
]
CONFIGS = GRID + EXTRA
# Steps of every run and of its reference (of k_steps micro-batches each with gradient merge):
# enough for momentum and Adam state, gradients kept as bucket views (zero_grad without
# set_to_none) and unused parameters to act over several steps; a wrong sum, scale or missed
# bucket shows from the first step on at rtol 1e-5. The first EQ_STEPS of `data`'s steps.
EQ_STEPS = 5
# One run over all of `data`'s STEPS: a small error that grows step by step (momentum, Adam
# state, merged micro-batches, bucket views, three communicators) has room to show.
LONG = Config(optimizer="adam", comms=3, cap_mb=0.001, k_steps=4, set_to_none=False)


def _train(rank: int, world: int, cfg: Config, steps: int = EQ_STEPS) -> dict[str, torch.Tensor]:
    import longboat as lb

    model = build_model(cfg, seed=rank)  # different init per rank: distribute must broadcast
    opt = build_optimizer(cfg, model)
    strategy = lb.Strategy(
        fuse_grad_size_in_MB=cfg.cap_mb,
        nccl_comm_num=cfg.comms,
        sync_nccl_allreduce=cfg.sync_each_comm,
        fuse_all_reduce_ops=cfg.fuse,
        find_unused_parameters=cfg.unused != "none",
        allreduce_algorithm=cfg.algorithm,
    )
    if cfg.k_steps > 1:
        strategy.gradient_merge = True
        strategy.gradient_merge_configs = {"k_steps": cfg.k_steps, "avg": True}
    dmodel, dopt = lb.distribute(model, opt, strategy)
    x, y = data(cfg)
    for i in range(steps * cfg.k_steps):
        dopt.zero_grad(set_to_none=cfg.set_to_none)
        loss = F.cross_entropy(
            dmodel(shard(x[i], rank, world), rank=rank), shard(y[i], rank, world)
        )
        loss.backward()
        dopt.step()
    return params_of(model)


def _ddp(rank: int, world: int, cfg: Config) -> dict[str, torch.Tensor]:
    model = build_model(cfg, seed=0)
    opt = build_optimizer(cfg, model)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    x, y = data(cfg)
    for i in range(EQ_STEPS):
        opt.zero_grad()
        F.cross_entropy(ddp(shard(x[i], rank, world)), shard(y[i], rank, world)).backward()
        opt.step()
    return params_of(model)


def _all_configs(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    import os

    import longboat as lb
    from longboat.comm.algorithms import auto

    # "auto" times its candidates on these sizes: MixedNet's buckets are at most 2 MB (its
    # 1024x256 weight in float64), so timing 4 and 32 MB allreduces would only cost time
    auto.SIZES = (4 << 10, 256 << 10, 2 << 20)
    if world == 4:  # two emulated nodes of two ranks: hierarchical really has two levels
        os.environ.update(
            LONGBOAT_NODE_RANK=str(rank // 2),
            LONGBOAT_NNODES="2",
            LOCAL_RANK=str(rank % 2),
            LOCAL_WORLD_SIZE="2",
        )
    lb.init()
    out = {}
    for cfg in CONFIGS:
        try:
            out[cfg.name] = _train(rank, world, cfg)
        except ValueError as e:  # shm across the two emulated nodes must be refused
            assert cfg.algorithm == "shm" and "on one node" in str(e), e
            out[cfg.name] = {"__refused__": torch.ones(1)}
    out["long-" + LONG.name] = _train(rank, world, LONG, STEPS)
    for cfg in (Config(optimizer="sgd"), Config(optimizer="adam")):
        out["ddp-" + cfg.name] = _ddp(rank, world, cfg)
    dist.barrier()
    return out


@pytest.fixture(
    scope="module",
    params=[2, pytest.param(4, marks=pytest.mark.slow)],  # 4 ranks: slow tier
    ids=["2ranks", "4ranks"],
)
def runs(request):
    world = request.param
    return world, run_ranks(_all_configs, world, timeout=600)


def _assert_close(actual, expected, what):
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(
            actual[name],
            expected[name],
            rtol=1e-5,
            atol=1e-6,
            msg=lambda m, n=name: f"{what}: {n}: {m}",
        )


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_matches_single_process(runs, cfg):
    world, results = runs
    if cfg.algorithm == "shm" and world == 4:  # two emulated nodes: shm is one node only
        assert all("__refused__" in r[cfg.name] for r in results)
        return
    expected = reference(cfg, world, EQ_STEPS)
    for rank, result in enumerate(results):
        _assert_close(result[cfg.name], expected, f"rank {rank} vs single process")
    # the reference really moved: a test that compares untrained weights proves nothing
    init = params_of(build_model(cfg, seed=0))
    assert any(not torch.allclose(init[n], expected[n]) for n in init)


def test_a_long_run_matches_single_process(runs):
    world, results = runs
    expected = reference(LONG, world, STEPS)
    for rank, result in enumerate(results):
        _assert_close(result["long-" + LONG.name], expected, f"rank {rank}, {STEPS} steps")


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_matches_torch_ddp(runs, optimizer):
    world, results = runs
    cfg = Config(optimizer=optimizer)
    for rank, result in enumerate(results):
        _assert_close(result[cfg.name], result["ddp-" + cfg.name], f"rank {rank} vs DDP")


def test_unused_everywhere_keeps_grad_none_like_single_process(runs):
    world, results = runs
    cfg = Config(optimizer="sgd", unused="always")
    init = params_of(build_model(cfg, seed=0))
    for result in results:
        torch.testing.assert_close(result[cfg.name]["extra.weight"], init["extra.weight"])
