"""Sharding stage 3 (FSDP2) at 2 Gloo ranks equals one process on the same global batches
(float32, within 1e-5): one spawn runs every case, each test checks one against its reference."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from tests._dist import run_ranks
from tests.sharding import _lm

WORLD, STEPS, BATCH, TOL = 2, 3, 4, 1e-5


def _opt(kind: str, net: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)
    if kind == "sgd_slow":  # bfloat16: rounding differs with the batch split, keep steps small
        return torch.optim.SGD(net.parameters(), lr=0.02, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    decay = [p for n, p in net.named_parameters() if p.dim() > 1]
    rest = [p for n, p in net.named_parameters() if p.dim() <= 1]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 3e-2}],
        lr=1e-2,
    )


CASES: dict[str, dict[str, Any]] = {
    "sgd_momentum": {"opt": "sgd"},
    "adamw_block_units": {"opt": "adamw", "configs": {"units": ["Block"]}},
    "groups_scheduler": {
        "opt": "groups",
        "scheduler": True,
        "fields": {"fuse_grad_size_in_MB": 0.004},
    },
    "clip": {"opt": "sgd", "clip": 0.3},
    "merge": {"opt": "adamw", "k_steps": 2},
    "hsdp": {"opt": "adamw", "configs": {"sharding_degree": 1}},
    "recompute_offload": {
        "opt": "adamw",
        "configs": {"units": ["Block"], "offload": True},
        "fields": {"recompute": True, "recompute_configs": {"checkpoints": ["blocks.0.mlp"]}},
    },
    "loads_plain_state": {"opt": "adamw", "loads": True},
    "amp_bf16": {"opt": "sgd_slow", "fields": {"amp": True, "amp_configs": {"dtype": "bfloat16"}}},
}


def _case(name: str, rank: int, world: int, directory: str) -> dict[str, Any]:
    import longboat as lb

    case = CASES[name]
    net = _lm.model(seed=9 if case.get("loads") else 0)  # loads: the state replaces it
    optimizer = _opt(case["opt"], net)
    scheduler = (
        torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        if case.get("scheduler")
        else None
    )
    fields = dict(case.get("fields", {}))
    if case.get("k_steps"):
        fields.update(gradient_merge=True, gradient_merge_configs={"k_steps": case["k_steps"]})
    strategy = lb.Strategy(
        sharding=True, sharding_configs={"stage": 3, **case.get("configs", {})}, **fields
    )
    model, opt = lb.distribute(net, optimizer, strategy)
    k = case.get("k_steps", 1)
    data = _lm.batches(STEPS * k, BATCH)
    if case.get("loads"):  # one plain step in this process, its state dicts loaded, then on
        plain = _lm.model()
        plain_opt = _opt(case["opt"], plain)
        _lm.train(plain, plain_opt, data[:1])
        model.load_state_dict({f"module.{k}": v for k, v in plain.state_dict().items()})
        opt.load_state_dict(plain_opt.state_dict())
        data = data[1:]
    norms = _lm.train(
        model,
        opt,
        data,
        rank=rank,
        world=world,
        k_steps=k,
        clip=case.get("clip"),
        scheduler=scheduler,
        clip_fn=model.clip_grad_norm_,
    )
    local = {n: p.to_local().shape for n, p in model.module.named_parameters()}
    if name == "adamw_block_units":  # per-rank files, read back by one process below
        lb.save_sharded_checkpoint(directory, opt, {"step": STEPS - 1})
    shard_dtype = str(next(model.module.parameters()).dtype)
    with torch.no_grad():
        logits_dtype = str(model(_lm.batches(1, BATCH)[0][0]).dtype)
    return {
        "logits_dtype": logits_dtype,
        "shard_dtype": shard_dtype,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "norms": norms,
        "local_numel": sum(s.numel() for s in local.values()),
        "lr": [g["lr"] for g in optimizer.param_groups],
    }


# float16 AMP: a scale of 2**24 overflows every gradient at step 0 (skipped, the scale shrinks
# to 2**14); at step 2 an inf lands in rank 1's shard only (as an overflow in the elements rank 1
# owns would): every rank must skip that step. The scale is applied where longboat applies it,
# to the gradient reaching the model's output, in the reference too.
FP16_STEPS, FP16_POISONED, FP16_CLIP = 4, 2, 100.0
FP16_SCALES = [2.0**24, 2.0**14, 2.0**14, 2.0**4]  # the scale each step runs at
FP16_CONFIGS = {
    "dtype": "float16",
    "init_loss_scaling": FP16_SCALES[0],
    "decr_every_n_nan_or_inf": 1,
    "decr_ratio": 2.0**-10,
    "incr_every_n_steps": 2,
}
FP16_TOL = 2e-4


def _fp16_case(rank: int, world: int) -> dict[str, Any]:
    import longboat as lb
    from longboat.optim.staged import StageKind

    net = _lm.model()
    strategy = lb.Strategy(
        sharding=True, sharding_configs={"stage": 3}, amp=True, amp_configs=FP16_CONFIGS
    )
    model, opt = lb.distribute(net, _opt("sgd_slow", net), strategy)
    norms = []
    for step, (tokens, targets) in enumerate(_lm.batches(FP16_STEPS, BATCH)):
        x, y = _lm.part(tokens, rank, world), _lm.part(targets, rank, world)
        _lm.loss_of(model, x, y).backward()
        if step == FP16_POISONED and rank == 1:
            model.module.embed.weight.grad.to_local()[0, 0] = float("inf")
        norms.append(float(model.clip_grad_norm_(FP16_CLIP)))
        opt.step()
        opt.zero_grad()
    scaler = opt.stage(StageKind.LOSS_SCALING).scaler
    with torch.no_grad():
        logits_dtype = str(model(_lm.batches(1, BATCH)[0][0]).dtype)
    return {
        "logits_dtype": logits_dtype,
        "model": model.state_dict(),
        "norms": norms,
        "history": list(scaler.history),
        "skipped": scaler.skipped_steps,
        "shard_dtype": str(next(model.module.parameters()).dtype),
    }


def _fp16_reference() -> dict[str, Any]:
    """One process: a float16 copy computes the gradients, scaled by FP16_SCALES at the
    output; the float32 model steps on them unscaled, or skips the step."""
    net = _lm.model()
    optimizer = _opt("sgd_slow", net)
    norms = []
    for step, (tokens, targets) in enumerate(_lm.batches(FP16_STEPS, BATCH)):
        low = copy.deepcopy(net).half()
        logits = low(tokens)
        logits.register_hook(lambda g, s=FP16_SCALES[step]: g * s)
        F.cross_entropy(logits.float().reshape(-1, _lm.VOCAB), targets.reshape(-1)).backward()
        for p, q in zip(net.parameters(), low.parameters(), strict=True):
            p.grad = q.grad.float() / FP16_SCALES[step]
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), FP16_CLIP)))
        if step not in (0, FP16_POISONED):
            optimizer.step()
        optimizer.zero_grad()
    return {"model": net, "norms": norms}


def _all_cases(rank: int, world: int, directory: str) -> dict[str, Any]:
    import longboat as lb

    lb.init(backend="gloo")
    out = {name: _case(name, rank, world, directory) for name in CASES}
    out["amp_fp16"] = _fp16_case(rank, world)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("stage3") / "ckpt")


@pytest.fixture(scope="module")
def ranks(saved: str) -> list[dict[str, Any]]:
    return run_ranks(_all_cases, WORLD, saved, timeout=240)


def _reference(name: str, compute: torch.dtype | None = None) -> dict[str, Any]:
    case = CASES[name]
    net = _lm.model()
    optimizer = _opt(case["opt"], net)
    if compute is not None:  # float32 master weights, forward and backward in ``compute``
        return _mixed_reference(net, optimizer, compute)
    scheduler = (
        torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        if case.get("scheduler")
        else None
    )
    k = case.get("k_steps", 1)

    def clip(max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)

    norms = _lm.train(
        net,
        optimizer,
        _lm.batches(STEPS * k, BATCH),
        k_steps=k,
        clip=case.get("clip"),
        scheduler=scheduler,
        clip_fn=clip,
    )
    return {"model": net, "optimizer": optimizer, "norms": norms}


def _mixed_reference(
    net: torch.nn.Module, optimizer: torch.optim.Optimizer, compute: torch.dtype
) -> dict[str, Any]:
    for tokens, targets in _lm.batches(STEPS, BATCH):
        low = copy.deepcopy(net).to(compute)
        _lm.loss_of(low, tokens, targets).backward()
        for p, q in zip(net.parameters(), low.parameters(), strict=True):
            p.grad = q.grad.float()
        optimizer.step()
        optimizer.zero_grad()
    return {"model": net, "optimizer": optimizer}


def _check(got: dict[str, Any], name: str) -> None:
    check_against(got, _reference(name))


def check_against(got: dict[str, Any], ref: dict[str, Any]) -> None:
    """``got`` (a rank's state dicts and clipped norms) equals the reference run's."""
    expected = {f"module.{k}": v for k, v in ref["model"].state_dict().items()}
    assert got["model"].keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(got["model"][key], value, atol=TOL, rtol=TOL, msg=key)
    plain = ref["optimizer"].state_dict()
    assert got["optimizer"]["param_groups"] == plain["param_groups"]
    assert got["optimizer"]["state"].keys() == plain["state"].keys()
    for i, state in plain["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(
                got["optimizer"]["state"][i][key], value, atol=TOL, rtol=TOL, msg=f"{i}.{key}"
            )
    assert got["norms"] == pytest.approx(ref["norms"], rel=TOL)


@pytest.mark.parametrize("name", [n for n in CASES if n != "amp_bf16"])
def test_stage3_equals_one_process(ranks: list[dict[str, Any]], name: str) -> None:
    for rank in ranks:
        _check(rank[name], name)


def test_parameters_are_split(ranks: list[dict[str, Any]]) -> None:
    total = sum(p.numel() for p in _lm.model().parameters())
    for rank in ranks:
        assert rank["sgd_momentum"]["local_numel"] <= total // WORLD + 64
    hsdp = [rank["hsdp"]["local_numel"] for rank in ranks]
    assert hsdp == [total, total]  # shard groups of one rank: every rank holds a copy


def test_state_dicts_load_into_the_unsharded_model(ranks: list[dict[str, Any]]) -> None:
    got = ranks[0]["adamw_block_units"]
    plain = _lm.model(seed=5)
    plain.load_state_dict({k.removeprefix("module."): v for k, v in got["model"].items()})
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    optimizer.load_state_dict(copy.deepcopy(got["optimizer"]))
    ref = _reference("adamw_block_units")
    for (name, p), q in zip(plain.named_parameters(), ref["model"].parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=TOL, rtol=TOL, msg=name)
    assert plain.head.weight is plain.embed.weight


def test_scheduler_on_the_users_optimizer_moves_the_sharded_step(
    ranks: list[dict[str, Any]],
) -> None:
    assert ranks[0]["groups_scheduler"]["lr"] == [1e-2 * 0.5**STEPS, 3e-2 * 0.5**STEPS]


def test_bf16_amp_computes_in_bf16_on_float32_shards_near_its_reference(
    ranks: list[dict[str, Any]],
) -> None:
    got = ranks[0]["amp_bf16"]
    assert (got["logits_dtype"], got["shard_dtype"]) == ("torch.bfloat16", "torch.float32")
    assert ranks[0]["adamw_block_units"]["logits_dtype"] == "torch.float32"
    ref = _reference("amp_bf16", compute=torch.bfloat16)
    for key, value in ref["model"].state_dict().items():
        torch.testing.assert_close(got["model"][f"module.{key}"], value, atol=2e-3, rtol=0)


def test_sharded_checkpoint_saved_at_2_ranks_reads_into_one_process(
    ranks: list[dict[str, Any]], saved: str
) -> None:
    from longboat.sharding.checkpoint import read_whole

    whole = read_whole(saved)
    assert whole["state"] == {"step": STEPS - 1}
    ref = _reference("adamw_block_units")
    plain = _lm.model(seed=5)
    plain.load_state_dict(whole["model"])
    for (name, p), q in zip(plain.named_parameters(), ref["model"].parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=TOL, rtol=TOL, msg=name)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    optimizer.load_state_dict(whole["optimizer"])
    for i, state in ref["optimizer"].state_dict()["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(optimizer.state_dict()["state"][i][key], value)


def test_fp16_amp_skips_overflowed_steps_on_every_rank_and_equals_its_reference(
    ranks: list[dict[str, Any]],
) -> None:
    ref = _fp16_reference()
    expected = {f"module.{k}": v for k, v in ref["model"].state_dict().items()}
    for rank in ranks:
        got = rank["amp_fp16"]
        assert (got["logits_dtype"], got["shard_dtype"]) == ("torch.float16", "torch.float32")
        assert got["skipped"] == 2
        assert got["history"] == FP16_SCALES[1:] + [FP16_SCALES[-1]]
        for key, value in expected.items():
            torch.testing.assert_close(got["model"][key], value, atol=FP16_TOL, rtol=0, msg=key)
        finite = [1, 3]  # clipped after unscaling: the norms of the true gradients
        assert [got["norms"][i] for i in finite] == pytest.approx(
            [ref["norms"][i] for i in finite], rel=FP16_TOL
        )
