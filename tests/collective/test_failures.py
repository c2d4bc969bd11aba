"""Misuse fails loudly on every rank instead of hanging."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tests._dist import run_ranks
from tests.collective._workloads import Config, build_model, data, shard


def _every_case(rank: int, world: int) -> dict[str, object]:
    """Every 2-rank case of this file in one spawn, each with its own model and lb.distribute
    (a refused lb.distribute leaves the group usable, as the settings case shows); the unused
    parameter last, as it fails inside a backward."""
    return {
        "no_sync": _no_sync_and_merge(rank, world),
        "mismatched": _mismatched(rank, world),
        "settings": _mismatched_settings(rank, world),
        "unused": _unused_without_flag(rank, world),
    }


@pytest.fixture(scope="module")
def runs() -> list[dict[str, object]]:
    return run_ranks(_every_case, 2, timeout=180)


def _mismatched(rank: int, world: int) -> str:
    import longboat as lb
    from longboat.collective.consistency import ModelMismatchError

    width = 8 if rank == 0 else 9  # rank 1 builds a different second layer
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, width))
    try:
        lb.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1))
    except ModelMismatchError as e:
        return str(e)
    return "no error"


def test_mismatched_models_raise_on_every_rank(runs):
    messages = [r["mismatched"] for r in runs]
    for msg in messages:
        assert "rank 1 differs from rank 0" in msg
        assert "'1.weight'" in msg and "(8, 8)" in msg and "(9, 8)" in msg


# field -> rank 1's value (rank 0 keeps the default); the message must name each one
_MISMATCHES: dict[str, dict] = {
    "allreduce_algorithm": {"allreduce_algorithm": "ring"},
    "nccl_comm_num": {"nccl_comm_num": 2},
    "fuse_grad_size_in_MB": {"fuse_grad_size_in_MB": 1},
    "fp16_allreduce": {"fp16_allreduce": True},
    "gradient_compression": {"gradient_compression": "powersgd"},
    "localsgd": {"localsgd": True},
    "gradient_merge": {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 4}},
}


def _mismatched_settings(rank: int, world: int) -> dict[str, str]:
    import longboat as lb
    from longboat.collective.consistency import SettingsMismatchError

    messages = {}
    for field, changes in _MISMATCHES.items():
        strategy = lb.Strategy(**changes) if rank == 1 else lb.Strategy()
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        try:
            lb.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy)
            messages[field] = "no error"
        except SettingsMismatchError as e:
            messages[field] = str(e)
    # a PowerSGD key set from the environment on rank 1 only
    env = {"LONGBOAT_POWERSGD_CONFIGS": '{"rank": 2}'} if rank == 1 else {}
    strategy = lb.Strategy(gradient_compression="powersgd", env=env)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    try:
        lb.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy)
        messages["powersgd_configs"] = "no error"
    except SettingsMismatchError as e:
        messages["powersgd_configs"] = str(e)
    # fields that act on one process only may differ
    strategy = lb.Strategy(num_threads=1 + rank, stall_shutdown_seconds=30.0 * rank)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    lb.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    return messages


def test_mismatched_settings_raise_on_every_rank_naming_the_field(runs):
    results = [r["settings"] for r in runs]
    assert results[0] == results[1]  # the same message on every rank
    for field, changes in _MISMATCHES.items():
        msg = results[0][field]
        assert "Strategy settings differ between ranks" in msg, (field, msg)
        for name in changes:
            assert f"  {name}" in msg, (field, msg)
        line = next(ln for ln in msg.splitlines() if ln.startswith(f"  {field}: "))
        value = changes[field]
        assert "on rank 1 (code)" in line and "on rank 0 (default)" in line, line
        if not isinstance(value, bool):
            assert repr(value) in line, line
    env_line = next(
        ln for ln in results[0]["powersgd_configs"].splitlines() if "powersgd_configs" in ln
    )
    assert env_line.startswith("  powersgd_configs.rank: 1 on rank 0 (default); 2 on rank 1 ")
    assert "(env:LONGBOAT_POWERSGD_CONFIGS)" in env_line, env_line


def _unused_without_flag(rank: int, world: int) -> str:
    import longboat as lb
    from longboat.collective.reducer import UnusedParametersError

    cfg = Config(unused="partial")  # extra layer used on rank 0 only
    model = build_model(cfg, seed=0)
    dmodel, opt = lb.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = data(cfg)
    try:
        F.cross_entropy(
            dmodel(shard(x[0], rank, world), rank=rank), shard(y[0], rank, world)
        ).backward()
    except UnusedParametersError as e:
        return str(e)
    return "no error"


def test_unused_parameter_without_find_unused_names_it_on_every_rank(runs):
    messages = [r["unused"] for r in runs]
    for msg in messages:
        assert "'extra.weight' (no gradient on 1 of 2 ranks)" in msg
        assert "find_unused_parameters=True" in msg
    assert "On this rank: extra.weight" in messages[1]
    assert "On this rank" not in messages[0]


def _no_sync_and_merge(rank: int, world: int) -> dict[str, torch.Tensor]:
    """no_sync accumulates locally, then one synced backward averages the sum."""
    import longboat as lb

    cfg = Config()
    model = build_model(cfg, seed=0)
    dmodel, opt = lb.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = data(cfg)
    opt.zero_grad()
    with dmodel.no_sync():
        F.cross_entropy(dmodel(shard(x[0], rank, world)), shard(y[0], rank, world)).backward()
    local = {n: p.grad.clone() for n, p in model.named_parameters()}
    F.cross_entropy(dmodel(shard(x[1], rank, world)), shard(y[1], rank, world)).backward()
    synced = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {"local." + n: t for n, t in local.items()} | {
        "synced." + n: t for n, t in synced.items()
    }


def test_no_sync_accumulates_then_averages(runs):
    world = 2
    results = [r["no_sync"] for r in runs]
    cfg = Config()
    ref = build_model(cfg, seed=0)
    x, y = data(cfg)
    # inside no_sync each rank keeps its own gradient: the two ranks differ
    assert not torch.allclose(results[0]["local.head.weight"], results[1]["local.head.weight"])
    for i in (0, 1):
        losses = [
            F.cross_entropy(ref(shard(x[i], r, world)), shard(y[i], r, world)) for r in range(world)
        ]
        torch.stack(losses).mean().backward()
    for result in results:
        for n, p in ref.named_parameters():
            torch.testing.assert_close(result["synced." + n], p.grad, rtol=1e-5, atol=1e-6)
