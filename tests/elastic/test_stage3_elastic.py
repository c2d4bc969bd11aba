"""Sharding stage 3 (FSDP2) across elastic membership changes, on real Gloo worlds formed and
dissolved in phases by one spawn of 3 processes: a rank joins a 2-rank job and takes its shards
from the others' memory; a rank leaves with the only copy of its shards and the job goes on
from the last sharded checkpoint; a rank leaves when there is no checkpoint and every rank
stops with one line naming what was lost. Each continued run equals one process trained on
the same global batches without stopping (float32, within 1e-5). Before them, a rank joins a
float16 AMP job, which goes on with the loss scale it reached, and an optimizer whose state is
not shaped like its parameters is refused at the first commit."""

from __future__ import annotations

import copy
import os
import shutil
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from tests._dist import free_port, run_ranks
from tests.sharding import _lm

K = 3  # steps before the first change; the checkpoint every K commits
MORE = 2  # steps of each later phase
BATCH = 6  # global batch: divides among 1, 2 and 3 ranks
PHASES = ("R", "FA", "FB", "A", "B", "C", "D")
# float16 AMP: the first step overflows at 2**24 (skipped; the scale drops to 2**10), the next
# ones grow it every 2 finite steps; a third rank joins after FP16_BEFORE steps
FP16_BEFORE, FP16_AFTER = 2, 3
FP16_CONFIGS = {
    "dtype": "float16",
    "init_loss_scaling": 2.0**24,
    "decr_every_n_nan_or_inf": 1,
    "decr_ratio": 2.0**-14,
    "incr_every_n_steps": 2,
}
FP16_TOL = 2e-4  # tests/sharding/test_stage3.py's float16 tolerance


def _optimizer(net: torch.nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in net.parameters() if p.dim() > 1]
    rest = [p for p in net.parameters() if p.dim() <= 1]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 3e-2}],
        lr=1e-2,
    )


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return _lm.batches(K + 2 * MORE, BATCH)


def reference() -> list[dict[str, torch.Tensor]]:
    """One process on every global batch: the state dict after 0, 1, ... steps."""
    net = _lm.model(0)
    optimizer = _optimizer(net)
    out = [{k: v.clone() for k, v in net.state_dict().items()}]
    for batch in _data():
        _lm.train(net, optimizer, [batch])
        out.append({k: v.clone() for k, v in net.state_dict().items()})
    return out


def _fp16_sgd(net: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=0.02, momentum=0.9)


def fp16_reference() -> dict[str, Any]:
    """One process: a float16 copy computes the gradients, scaled at the output by Fleet's
    dynamic loss scale; the float32 model steps on them unscaled, or skips an overflowed step."""
    from longboat.collective.amp import LossScaler

    net = _lm.model(0)
    optimizer = _fp16_sgd(net)
    scaler = LossScaler(
        scale=FP16_CONFIGS["init_loss_scaling"],
        incr_every_n_steps=FP16_CONFIGS["incr_every_n_steps"],
        decr_every_n_nan_or_inf=FP16_CONFIGS["decr_every_n_nan_or_inf"],
        decr_ratio=FP16_CONFIGS["decr_ratio"],
    )
    scalers = [scaler.state_dict()]
    for tokens, targets in _data()[: FP16_BEFORE + FP16_AFTER]:
        low = copy.deepcopy(net).half()
        logits = low(tokens)
        logits.register_hook(lambda g, s=scaler.scale: g * s)
        F.cross_entropy(logits.float().reshape(-1, _lm.VOCAB), targets.reshape(-1)).backward()
        grads = [q.grad.float() / scaler.scale for q in low.parameters()]
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        if finite:
            for p, g in zip(net.parameters(), grads, strict=True):
                p.grad = g
            optimizer.step()
        optimizer.zero_grad()
        scaler.update(finite)
        scalers.append(scaler.state_dict())
    return {"model": net.state_dict(), "scalers": scalers}


class Factored(torch.optim.Optimizer):
    """SGD keeping, per matrix, the mean squared gradient of each row (a factored state, as
    Adafactor's): state not shaped like its parameter."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    square = p.grad.square()
                    self.state[p]["rows"] = square.mean(dim=-1) if p.dim() > 1 else square
                    p.sub_(group["lr"] * p.grad)


# -- the spawned ranks ------------------------------------------------------------------------


def _join(rank: int, world: int, port: int) -> None:
    import longboat as lb

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_PORT=str(port),
    )
    lb.init(backend="gloo")


def _distributed(seed: int, ckpt: str) -> tuple[Any, Any, Any]:
    """A stage 3 model, optimizer and elastic state (each rank builds its own model)."""
    import longboat as lb

    net = _lm.model(seed)
    strategy = lb.Strategy(sharding=True, sharding_configs={"stage": 3, "units": ["Block"]})
    model, optimizer = lb.distribute(net, _optimizer(net), strategy)
    state = lb.elastic.State(model=model, optimizer=optimizer, checkpoint=ckpt, checkpoint_every=K)
    return model, optimizer, state


def _train(model: Any, optimizer: Any, state: Any, until: int) -> dict[str, torch.Tensor]:
    """Train from ``state.commits`` to commit ``until``, committing each step; the whole
    state dict after (collective)."""
    import longboat as lb

    data = _data()
    while state.commits < until:
        _lm.train(model, optimizer, [data[state.commits]], rank=lb.rank(), world=lb.world_size())
        state.commit()
    return {k.removeprefix("module."): v for k, v in model.state_dict().items()}


def _scaler(optimizer: Any) -> Any:
    from longboat.optim.staged import StageKind

    return optimizer.stage(StageKind.LOSS_SCALING).scaler


def _fp16_join(rank: int, ports: dict[str, int]) -> dict[str, Any]:
    """FA: ranks 0 and 1 train FP16_BEFORE float16 AMP steps; FB: rank 2 joins, 3 ranks train
    FP16_AFTER more."""
    import longboat as lb

    strategy = lb.Strategy(
        sharding=True,
        sharding_configs={"stage": 3, "units": ["Block"]},
        amp=True,
        amp_configs=FP16_CONFIGS,
    )
    out: dict[str, Any] = {}
    if rank < 2:
        _join(rank, 2, ports["FA"])
    else:
        _join(0, 1, ports["R"])  # meanwhile, alone: a factored optimizer state is refused
        net = _lm.model(0)
        plain = lb.Strategy(sharding=True, sharding_configs={"stage": 3})
        model, optimizer = lb.distribute(net, Factored(net.parameters()), plain)
        state = lb.elastic.State(model=model, optimizer=optimizer)
        _lm.train(model, optimizer, _data()[:1])
        try:
            state.commit()
        except ValueError as refused:
            out["refused"] = str(refused)
        lb.shutdown()
        _join(rank, 3, ports["FB"])
    net = _lm.model(rank if rank < 2 else 7)  # the joiner's own model: it takes the job's
    model, optimizer = lb.distribute(net, _fp16_sgd(net), strategy)
    state = lb.elastic.State(model=model, optimizer=optimizer)
    state.sync()
    if rank < 2:
        _train(model, optimizer, state, FP16_BEFORE)
        _moved(state, rank, 3, ports["FB"])
    out["fp16 from"] = (state.commits, _scaler(optimizer).state_dict())
    out["fp16"] = _train(model, optimizer, state, FP16_BEFORE + FP16_AFTER)
    out["fp16 scaler"] = _scaler(optimizer).state_dict()
    lb.shutdown()
    return out


def _moved(state: Any, rank: int, world: int, port: int) -> int:
    """What ``lb.elastic.run`` does on a rank that keeps its state through a change: leave the
    old world, join the new one, rebuild, sync; returns the commit it resumes from."""
    import longboat as lb

    lb.shutdown()
    _join(rank, world, port)
    state.on_reset()
    state.sync()
    return state.commits


def _phases(rank: int, world: int, ports: dict[str, int], ckpt: str) -> dict[str, Any]:
    """A: ranks 0 and 1 train K steps (a checkpoint at K). B: rank 2 joins; 3 ranks train
    MORE. C: rank 2 leaves with its shards; ranks 0 and 1 take the checkpoint and train on.
    D: the checkpoint is gone and rank 1 leaves; rank 0 must stop, naming the lost shard."""
    import longboat as lb
    from longboat.elastic.reshard import ShardsLostError

    out: dict[str, Any] = _fp16_join(rank, ports)
    if rank < 2:
        _join(rank, 2, ports["A"])
        model, optimizer, state = _distributed(rank, ckpt)
        state.sync()
        out["A"] = _train(model, optimizer, state, K)
        out["B from"] = _moved(state, rank, 3, ports["B"])
    else:
        _join(rank, 3, ports["B"])
        model, optimizer, state = _distributed(7, ckpt)  # another model: it takes the job's
        state.sync()
        out["B from"] = state.commits
    out["B"] = _train(model, optimizer, state, K + MORE)
    out["B shards"] = sum(p.to_local().numel() for p in model.module.parameters())
    if rank == 2:
        lb.shutdown()
        return out
    out["C from"] = _moved(state, rank, 2, ports["C"])
    out["C"] = _train(model, optimizer, state, K + 2 * MORE)
    if rank == 1:
        lb.shutdown()
        return out
    lb.shutdown()
    shutil.rmtree(ckpt)
    try:
        _moved(state, 0, 1, ports["D"])
    except ShardsLostError as lost:
        out["D"] = str(lost)
    lb.shutdown()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    ckpt = tmp_path_factory.mktemp("stage3") / "ckpt"
    ports = {phase: free_port() for phase in PHASES}
    return run_ranks(_phases, 3, ports, str(ckpt), timeout=400)


@pytest.fixture(scope="module")
def expected() -> list[dict[str, torch.Tensor]]:
    return reference()


def _close(actual: dict, expected: dict, what: str) -> None:
    assert sorted(actual) == sorted(expected), what
    for name, value in expected.items():
        torch.testing.assert_close(
            actual[name], value, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{what}: {n}: {m}"
        )


@pytest.mark.slow  # worlds of up to 3 FSDP2 ranks, one after another
def test_float16_amp_goes_on_with_the_loss_scale_it_reached_when_a_rank_joins(runs):
    ref = fp16_reference()
    scalers = ref["scalers"]
    assert [s["scale"] for s in scalers] == [2.0**24, 2.0**10, 2.0**10, 2.0**11, 2.0**11, 2.0**12]
    for rank, r in enumerate(runs):
        assert r["fp16 from"] == (FP16_BEFORE, scalers[FP16_BEFORE]), f"rank {rank}"
        assert r["fp16 scaler"] == scalers[-1], f"rank {rank}"
        assert sorted(r["fp16"]) == sorted(ref["model"])
        for name, value in ref["model"].items():
            torch.testing.assert_close(
                r["fp16"][name], value, atol=FP16_TOL, rtol=0, msg=f"rank {rank}: {name}"
            )


@pytest.mark.slow  # worlds of up to 3 FSDP2 ranks, one after another
def test_an_optimizer_state_not_shaped_like_its_parameter_is_refused_at_commit(runs):
    refused = runs[2]["refused"]
    assert "optimizer state 'rows' of " in refused and "use stage 1 or 2" in refused, refused


@pytest.mark.slow  # four worlds of up to 3 FSDP2 ranks, one after another
def test_two_ranks_before_any_change_equal_one_process(runs, expected):
    for rank in (0, 1):
        _close(runs[rank]["A"], expected[K], f"rank {rank} of 2")


@pytest.mark.slow  # four worlds of up to 3 FSDP2 ranks, one after another
def test_a_rank_that_joins_takes_its_shards_from_memory_and_training_equals_one_process(
    runs, expected
):
    assert [r["B from"] for r in runs] == [K, K, K]
    for rank, r in enumerate(runs):
        _close(r["B"], expected[K + MORE], f"rank {rank} of 3 after the join")
    numel = sum(v.numel() for k, v in expected[0].items() if k != "head.weight")
    assert sum(r["B shards"] for r in runs) == numel  # split three ways, nothing twice


@pytest.mark.slow  # four worlds of up to 3 FSDP2 ranks, one after another
def test_a_rank_that_leaves_with_its_shards_resumes_from_the_sharded_checkpoint(
    runs, expected
):
    assert [r["C from"] for r in runs[:2]] == [K, K]  # the checkpoint's commit, not K + MORE
    for rank, r in enumerate(runs[:2]):
        _close(r["C"], expected[K + 2 * MORE], f"rank {rank} of 2 after the leave")


@pytest.mark.slow  # four worlds of up to 3 FSDP2 ranks, one after another
def test_shards_lost_without_a_checkpoint_stop_with_one_line_naming_them(runs):
    lost = runs[0]["D"]
    assert "\n" not in lost
    assert "shard 1 of 2, held only by rank 1 of the previous 2-rank world" in lost, lost
    assert "embed.weight[" in lost and "lb.elastic.State(checkpoint=" in lost, lost
    assert "no checkpoint in" in lost, lost


def test_an_elastic_strategy_takes_stage_3():
    import longboat as lb

    lb.Strategy(sharding=True, sharding_configs={"stage": 3}, elastic=True).check()
