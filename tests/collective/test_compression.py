"""Gradient compression selected by the Strategy, through lb.distribute (2 Gloo ranks).

Each case is checked against a single-process reference on the global batch: DGC before its
warm-up ends is momentum SGD; DGC sending every entry is SGD without momentum on the
sparsified tensors and with it on the rest; PowerSGD during warm-up is exact.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from longboat.comm.compress import ring_bytes
from tests._dist import run_ranks
from tests.collective._workloads import (
    STEPS,
    Config,
    build_model,
    build_optimizer,
    data,
    params_of,
    shard,
    train_global_batch,
)

WORLD = 2
CFG = Config()
MIN_NUMEL = 16384


def _strategy(case: str):
    import longboat as lb

    if case == "dgc_warmup":
        return lb.Strategy(dgc=True, dgc_configs={"rampup_begin_step": STEPS})
    if case == "dgc_dense":
        return lb.Strategy(dgc=True, dgc_configs={"sparsity": [0.0]})
    if case == "dgc_sparse":
        configs = {"rampup_begin_step": 2, "sparsity": [0.999], "min_numel": 1000}
        return lb.Strategy(dgc=True, dgc_configs=configs)
    if case == "powersgd_warmup":
        return lb.Strategy(gradient_compression="powersgd", powersgd_configs={"start_step": STEPS})
    if case == "powersgd":
        return lb.Strategy(
            gradient_compression="powersgd",
            powersgd_configs={"start_step": 2, "rank": 4, "min_compression_bytes": 0},
        )
    return lb.Strategy(gradient_compression=case)


CASES = ("dgc_warmup", "dgc_dense", "dgc_sparse", "powersgd_warmup", "powersgd", "bf16")


def _rank(rank: int, world: int) -> dict[str, Any]:
    import longboat as lb

    lb.init()
    x, y = data(CFG)
    out: dict[str, Any] = {}
    for case in CASES:
        model = build_model(CFG, seed=rank)
        dmodel, opt = lb.distribute(model, build_optimizer(CFG, model), _strategy(case))
        losses = []
        before = 0
        for i in range(STEPS):
            opt.zero_grad()
            loss = F.cross_entropy(dmodel(shard(x[i], rank, world)), shard(y[i], rank, world))
            before = dmodel.bytes_sent()
            loss.backward()
            opt.step()
            losses.append(float(loss))
        out[case] = {
            "params": params_of(model),
            "losses": losses,
            "last_bytes": dmodel.bytes_sent() - before,
            "momentum": [g["momentum"] for g in opt.param_groups],
        }
    try:
        model = build_model(CFG, seed=rank)
        lb.distribute(model, torch.optim.Adam(model.parameters()), lb.Strategy(dgc=True))
    except ValueError as exc:
        out["adam_error"] = str(exc)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_rank, WORLD, timeout=240)


def _reference(dgc_split: bool) -> dict[str, torch.Tensor]:
    model = build_model(CFG, seed=0)
    if not dgc_split:
        return train_global_batch(model, build_optimizer(CFG, model), CFG, WORLD)
    big = [p for p in model.parameters() if p.numel() >= MIN_NUMEL]
    rest = [p for p in model.parameters() if not any(p is b for b in big)]
    opt = torch.optim.SGD([{"params": big, "momentum": 0.0}, {"params": rest}], 0.05, 0.9)
    return train_global_batch(model, opt, CFG, WORLD)


def _assert_close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], **tol: float):
    for name, value in ref.items():
        torch.testing.assert_close(got[name], value, **tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("case", ["dgc_warmup", "powersgd_warmup"])
def test_warmup_equals_uncompressed_training(ranks: list[dict[str, Any]], case: str):
    ref = _reference(dgc_split=False)
    for out in ranks:
        _assert_close(out[case]["params"], ref, rtol=1e-5, atol=1e-6)


def test_dgc_sending_everything_is_sgd_with_momentum_only_on_dense_tensors(ranks):
    ref = _reference(dgc_split=True)
    for out in ranks:
        _assert_close(out["dgc_dense"]["params"], ref, rtol=1e-5, atol=1e-6)


def test_dgc_sparse_sends_under_one_percent_and_keeps_the_optimizer_intact(ranks):
    model = build_model(CFG, seed=0)
    numel = sum(p.numel() for p in model.parameters())
    dense = ring_bytes(numel * 4, WORLD)
    for out in ranks:
        run = out["dgc_sparse"]
        assert run["last_bytes"] < 0.01 * dense, (run["last_bytes"], dense)
        assert run["momentum"] == [0.9]  # switched off only inside each sparse step
        assert all(math.isfinite(v) for v in run["losses"])
    for name in ranks[0]["dgc_sparse"]["params"]:
        assert torch.equal(
            ranks[0]["dgc_sparse"]["params"][name], ranks[1]["dgc_sparse"]["params"][name]
        )


def test_powersgd_compresses_per_parameter_and_trains(ranks: list[dict[str, Any]]):
    model = build_model(CFG, seed=0)
    dense = p = q = 0
    for param in model.parameters():
        rows, cols = (param.shape[0], param[0].numel()) if param.dim() >= 2 else (1, param.numel())
        r = min(4, rows, cols)
        if param.dim() >= 2 and (rows + cols) * r < param.numel():
            p, q = p + rows * r, q + cols * r
        else:
            dense += param.numel()
    flags = ring_bytes(len(list(model.parameters())) * 4, WORLD)  # used-parameter flags, apart
    expected = ring_bytes((dense + p) * 4, WORLD) + ring_bytes(q * 4, WORLD) + flags
    for out in ranks:
        run = out["powersgd"]
        assert run["last_bytes"] == expected  # P (+ uncompressed), Q and the flags
    # it moves the parameters toward where uncompressed training takes them
    ref, start = _reference(dgc_split=False), dict(build_model(CFG, seed=0).named_parameters())
    got = ranks[0]["powersgd"]["params"]
    travelled = sum(float((ref[n] - start[n].detach()).norm() ** 2) for n in ref) ** 0.5
    missed = sum(float((ref[n] - got[n]).norm() ** 2) for n in ref) ** 0.5
    assert missed < 0.5 * travelled
    for name in ranks[0]["powersgd"]["params"]:
        assert torch.equal(
            ranks[0]["powersgd"]["params"][name], ranks[1]["powersgd"]["params"][name]
        )


def test_bf16_allreduce_tracks_uncompressed(ranks: list[dict[str, Any]]):
    ref = _reference(dgc_split=False)
    for out in ranks:
        _assert_close(out["bf16"]["params"], ref, rtol=0.0, atol=2e-2)


def test_dgc_refuses_adam_on_every_rank(ranks: list[dict[str, Any]]):
    for out in ranks:
        assert "torch.optim.SGD" in out["adam_error"] and "Adam" in out["adam_error"]
