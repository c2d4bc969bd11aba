"""Sharding with what it combines with: LARS and LAMB (each rank steps slices of parameters,
and the trust ratio takes the norms of the whole parameters, summed over the shard group),
a float16/bfloat16 reduce-scatter, several communicators. Each equals one process on the
global batch (the low-precision ones within their rounding) and longboat without sharding.
One spawn for the module."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from tests._dist import run_ranks

WORLD, STEPS, BATCH = 2, 4, 16
WIDTHS = (12, 37, 29, 5)  # odd sizes: slices cut parameters between the ranks
LAMB_CONFIGS = {"lamb_weight_decay": 0.01, "exclude_from_weight_decay": ["bias"]}
LARS_CONFIGS = {"lars_coeff": 0.01, "lars_weight_decay": 0.001, "exclude_from_weight_decay": ["0."]}


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(WIDTHS, WIDTHS[1:], strict=False):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1]).double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(STEPS, BATCH, WIDTHS[0], generator=g, dtype=torch.float64)
    return x, torch.randint(0, WIDTHS[-1], (STEPS, BATCH), generator=g)


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    from longboat.optim import wrap_optimizer

    base = _base(kind, model)
    configs = LAMB_CONFIGS if kind == "lamb" else LARS_CONFIGS
    return wrap_optimizer(kind, base, model.named_parameters(), configs)


def _base(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer the user passes; Fleet's field replaces it (LAMB takes Adam's betas)."""
    if kind in ("lamb", "adam"):
        return torch.optim.Adam(model.parameters(), lr=0.05)
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def reference(kind: str) -> dict[str, torch.Tensor]:
    model = _model()
    optimizer = _base(kind, model) if kind == "adam" else _optimizer(kind, model)
    x, y = _data()
    for i in range(STEPS):
        optimizer.zero_grad()
        F.cross_entropy(model(x[i]), y[i]).backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(
    rank: int, kind: str, stage: int | None, degree: int, **fields: Any
) -> dict[str, torch.Tensor]:
    import longboat as lb

    model = _model()
    strategy = lb.Strategy(fuse_grad_size_in_MB=0.002, **fields)  # several buckets
    if kind != "adam":  # Fleet's meta-optimizer field replaces the optimizer
        setattr(strategy, kind, True)
        setattr(strategy, f"{kind}_configs", LAMB_CONFIGS if kind == "lamb" else LARS_CONFIGS)
    if stage is not None:
        strategy.sharding = True
        strategy.sharding_configs = {"stage": stage, "sharding_degree": degree}
    dmodel, dopt = lb.distribute(model, _base(kind, model), strategy)
    x, y = _data()
    half = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    for i in range(STEPS):
        dopt.zero_grad()
        F.cross_entropy(dmodel(x[i][half]), y[i][half]).backward()
        dopt.step()
    dmodel.settle_parameters()
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    if stage is not None:
        step = dopt.stages[-1].shards
        out["__cut__"] = torch.tensor(
            [sum(p.start > 0 or p.stop < step.params[p.param].numel() for _, p in step.pieces)]
        )
    return out


WIRES = {"bf16": {"gradient_compression": "bf16"}, "fp16": {"fp16_allreduce": True}}
RUNS: dict[str, tuple[str, int | None, int, dict[str, Any]]] = {
    **{
        f"{kind}-{stage}-{degree}": (kind, stage, degree, {})
        for kind in ("lamb", "lars")
        for stage, degree in ((None, 0), (1, 0), (2, 0), (2, 1))
    },
    **{
        f"{wire}-{stage}-{degree}": ("adam", stage, degree, fields)
        for wire, fields in WIRES.items()
        for stage, degree in ((None, 0), (2, 0), (2, 1))
    },
    **{f"comms-{stage}": ("adam", stage, 0, {"nccl_comm_num": 2}) for stage in (1, 2)},
}


def _all(rank: int, world: int) -> dict[str, Any]:
    import longboat as lb

    lb.init()
    out = {name: _train(rank, *args, **fields) for name, (*args, fields) in RUNS.items()}
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_ranks(_all, WORLD, timeout=600)


@pytest.mark.parametrize("kind", ["lamb", "lars"])
@pytest.mark.parametrize("stage,degree", [(1, 0), (2, 0), (2, 1)])
def test_layerwise_optimizers_shard_as_one_process_steps(runs, kind, stage, degree):
    expected = reference(kind)
    for r in runs:
        sharded = r[f"{kind}-{stage}-{degree}"]
        if degree == 0:
            assert sharded["__cut__"].item() > 0  # some parameter's norm spans both ranks
        for name, value in expected.items():
            torch.testing.assert_close(sharded[name], value, rtol=1e-9, atol=1e-11)
            plain = r[f"{kind}-None-0"][name]
            torch.testing.assert_close(sharded[name], plain, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("wire", ["bf16", "fp16"])
@pytest.mark.parametrize("degree", [0, 1])
def test_a_low_precision_reduce_scatter(runs, wire, degree):
    expected = reference("adam")
    for r in runs:
        sharded, plain = r[f"{wire}-2-{degree}"], r[f"{wire}-None-0"]
        worst = max(float((sharded[n] - v).abs().max()) for n, v in expected.items())
        allreduced = max(float((plain[n] - v).abs().max()) for n, v in expected.items())
        assert 1e-7 < worst < 5 * allreduced  # it travels rounded, as the allreduce does


@pytest.mark.parametrize("stage", [1, 2])
def test_several_communicators(runs, stage):
    expected = reference("adam")
    for r in runs:
        for name, value in expected.items():
            torch.testing.assert_close(r[f"comms-{stage}"][name], value, rtol=1e-9, atol=1e-11)
