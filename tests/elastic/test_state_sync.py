"""`State.sync` bookkeeping and its digest check, on real Gloo process groups: a rank alone
holds the state, a joiner after a one-rank world receives it bit for bit, and ranks whose
state differs are named in an error on every rank."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import longboat as lb
from longboat.elastic.state import DIGEST_PARTS, State, StateMismatchError
from tests._dist import run_ranks


def _job(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    sampler = lb.elastic.ElasticSampler(32, 4, shuffle=True, seed=3)
    return net, optimizer, sampler


def _step(state: State, net: torch.nn.Module, optimizer: torch.optim.Optimizer, i: int) -> None:
    x = torch.full((4, 4), float(i + 1)) / 7
    loss = net(x).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    state.sampler.record_batch()
    state.commit()


def _everything(state: State) -> dict[str, Any]:
    """The whole state, as plain tensors and values (for exact comparison)."""
    return {
        "commits": state.commits,
        "model": state.model.state_dict(),
        "optimizer": state.optimizer.state_dict(),
        "sampler": state.sampler.state_dict(),
        "digest": state.digest(),
        "holds_state": state.holds_state,
    }


def test_a_rank_alone_holds_the_state_after_sync_without_a_process_group():
    net, optimizer, sampler = _job()
    state = State(model=net, optimizer=optimizer, sampler=sampler)
    assert not state.holds_state
    assert state.sync() == 0
    assert state.holds_state


def _alone_in_a_one_rank_group(rank: int, world: int) -> dict[str, Any]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    net, optimizer, sampler = _job()
    state = State(model=net, optimizer=optimizer, sampler=sampler)
    before = state.holds_state
    source = state.sync()
    return {"before": before, "after": state.holds_state, "source": source}


def test_a_rank_alone_in_a_one_rank_process_group_holds_the_state_after_sync():
    (result,) = run_ranks(_alone_in_a_one_rank_group, 1, timeout=120)
    assert result == {"before": False, "after": True, "source": 0}


def _join_after_a_world_of_one(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 trains alone in a world of one for 3 commits; rank 1 then joins a world of two
    with a differently initialised model and no optimizer state."""
    if rank == 0:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        net, optimizer, sampler = _job(seed=0)
        state = State(model=net, optimizer=optimizer, sampler=sampler, epoch=0)
        state.sync()
        sampler.set_epoch(0)
        for i in range(3):
            _step(state, net, optimizer, i)
        dist.destroy_process_group()
        before = _everything(state)
    else:
        net, optimizer, sampler = _job(seed=1)
        state = State(model=net, optimizer=optimizer, sampler=sampler, epoch=0)
        before = _everything(state)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    source = state.sync()
    return {"source": source, "before": before, "after": _everything(state)}


def _assert_identical(a: Any, b: Any, where: str = "state") -> None:
    """Equal bit for bit: tensors by dtype, shape and bytes; containers element-wise."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=repr) == sorted(b, key=repr), where
        for key in a:
            _assert_identical(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_a_joiner_after_a_world_of_one_receives_the_whole_state_bit_for_bit():
    survivor, joiner = run_ranks(_join_after_a_world_of_one, 2, timeout=120)
    assert survivor["source"] == joiner["source"] == 0
    assert survivor["before"]["holds_state"] and not joiner["before"]["holds_state"]
    assert survivor["before"]["commits"] == 3 and joiner["before"]["commits"] == 0
    assert joiner["before"]["digest"] != survivor["before"]["digest"]
    for side in (survivor, joiner):
        _assert_identical(side["after"], {**survivor["before"], "holds_state": True})


def _differing_states(rank: int, world: int) -> None:
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    net, optimizer, sampler = _job(seed=1 if rank == 1 else 0)  # rank 1 built another model
    State(model=net, optimizer=optimizer, sampler=sampler).sync()


def test_ranks_whose_state_differs_are_named_on_every_rank():
    assert issubclass(StateMismatchError, lb.elastic.ElasticError)
    assert lb.elastic.StateMismatchError is StateMismatchError
    failed = run_ranks(_differing_states, 3, timeout=120, allow_failure=True)
    assert set(failed.errors) == {0, 1, 2}, failed
    for text in failed.errors.values():
        assert "StateMismatchError" in text, text
        assert "state of rank 1 differs from rank 0's" in text, text
        assert "rank 1: parameters" in text and "rank 2" not in text.split("differs")[0], text


def test_the_digest_sees_every_part_and_every_bit():
    net, optimizer, sampler = _job()
    state = State(model=net, optimizer=optimizer, sampler=sampler)
    base = state.digest()
    assert len(base) == len(DIGEST_PARTS)
    with torch.no_grad():
        weight = next(net.parameters())
        bits = weight.view(torch.int32)
        bits[0, 0] ^= 1  # the lowest mantissa bit of one parameter
    changed = state.digest()
    assert [a != b for a, b in zip(base, changed, strict=True)] == [False, True, False, False]
    with torch.no_grad():
        bits[0, 0] ^= 1
    assert state.digest() == base
    state.commits += 1
    assert state.digest()[0] != base[0]


def test_the_digest_leaves_buffers_out():
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    state = State(model=net)
    base = state.digest()
    net(torch.randn(8, 4))  # training-mode forward: running statistics move, parameters do not
    assert state.digest() == base


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_the_digest_hashes_tensors_of_any_dtype(dtype):
    net = torch.nn.Linear(3, 2).to(dtype) if dtype.is_floating_point else None
    state = State(model=net, values=torch.arange(4).to(dtype))
    assert len(state.digest()) == len(DIGEST_PARTS)


def test_float16_loss_scale_is_kept_with_the_optimizer_state():
    """The loss scaler (stages 0-2 reach it through the model's Amp) is snapshotted, restored,
    sent to a joiner, written to checkpoints and digested like the optimizer's state."""
    import types

    from longboat.collective.amp import LossScaler
    from longboat.collective.optimizer import LossScaling
    from longboat.optim.staged import StagedOptimizer

    def job() -> tuple[State, LossScaler]:
        net, optimizer, _ = _job()
        scaler = LossScaler(scale=2.0**16, incr_every_n_steps=3)
        model = types.SimpleNamespace(amp=types.SimpleNamespace(scaler=scaler))
        staged = StagedOptimizer(optimizer, [LossScaling(model)])  # type: ignore[arg-type]
        return State(model=net, optimizer=staged), scaler

    state, scaler = job()
    scaler.update(True)
    state.commit()
    committed = scaler.state_dict()
    assert committed == {"scale": 2.0**16, "good_steps": 1, "bad_steps": 0, "skipped_steps": 0}
    base = state.digest()
    scaler.update(False)
    scaler.update(False)  # the scale shrinks; the step was not committed
    assert scaler.scale < 2.0**16
    assert [a != b for a, b in zip(base, state.digest(), strict=True)] == [
        False,
        False,
        True,  # the loss scale is part of the optimizer state
        False,
    ]
    state.restore()
    assert scaler.state_dict() == committed
    joiner, theirs = job()
    joiner._load(state._payload())  # what a joiner receives, and what a checkpoint holds
    assert theirs.state_dict() == committed
    assert joiner.digest() == state.digest()
