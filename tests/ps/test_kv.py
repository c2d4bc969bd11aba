"""kv access: init / push / pull by key on the same servers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from longboat.ps.trainer.kv import KVClient
from tests.ps._harness import servers


def test_assign_without_optimizer_and_blocks_spread_over_servers() -> None:
    with servers(2) as (eps, token):
        kv = KVClient(eps, token, min_block_size=16)
        value = torch.arange(64.0).reshape(16, 4)
        kv.init("w", value)
        assert {s for s, _, _ in kv._blocks("w", value.shape)} == {0, 1}
        assert torch.equal(kv.pull("w"), value)
        kv.init("w", torch.zeros(16, 4))  # the first init wins
        assert torch.equal(kv.pull("w"), value)
        kv.push("w", value * 3)
        assert torch.equal(kv.pull("w"), value * 3)
        with pytest.raises(KeyError, match="init"):
            kv.pull("nope")
        kv.close()


def test_sync_pushes_are_averaged_then_sgd_applied_once() -> None:
    with servers(2) as (eps, token):
        kvs = [KVClient(eps, token, trainer=r, trainers=2, sync=True, optimizer="sgd",
                        hparams={"lr": 0.5}) for r in range(2)]  # fmt: skip
        start = torch.ones(3, 5)
        for kv in kvs:
            kv.init("b", start)
        grads = [torch.full((3, 5), 2.0), torch.full((3, 5), 4.0)]
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda r: kvs[r].push("b", grads[r]), range(2)))
            pulled = list(pool.map(lambda r: kvs[r].pull("b"), range(2)))
        for value in pulled:
            assert torch.equal(value, start - 0.5 * 3.0)  # mean gradient 3, lr 0.5
        for kv in kvs:
            kv.close()


def test_configure_between_steps_only_and_reduce_survives_checkpoints() -> None:
    from longboat.ps.server.state import RequestError, ServerState
    from longboat.ps.shared.wire import Message

    state = ServerState(0, 1)
    spec = {"key": "k", "update": "assign", "reduce": "sum"}
    state.init(Message({"trainers": 2, "sync": True, "blocks": [spec]}, {"k": torch.zeros(3)}))
    state.push(Message({"trainer": 0, "step": 0}, {"k": torch.ones(3)}))
    sgd = {"key": "k", "update": "optimizer", "optimizer": "sgd", "hparams": {"lr": 1.0}}
    with pytest.raises(RequestError, match="between steps"):
        state.configure(Message({"blocks": [sgd]}))
    state.push(Message({"trainer": 1, "step": 0}, {"k": torch.full((3,), 2.0)}))
    assert torch.equal(state.blocks["k"].value, torch.full((3,), 3.0))  # summed, not averaged
    restored = ServerState(0, 1)
    restored.load_state_dict(state.state_dict())
    assert restored.blocks["k"].reduce == "sum"
    state.configure(Message({"blocks": [{**sgd, "reduce": "sum"}]}))
    for trainer in range(2):
        state.push(Message({"trainer": trainer, "step": 1}, {"k": torch.ones(3)}))
    assert torch.equal(state.blocks["k"].value, torch.ones(3))  # 3 - 1.0 * (1 + 1)
    with pytest.raises(RequestError, match="no block"):
        state.configure(Message({"blocks": [{**sgd, "key": "nope"}]}))


def test_sync_step_with_two_learning_rates_is_refused_naming_both() -> None:
    """The connect-time check leaves the learning rate out (schedulers change it): every sync
    push carries it, and a step whose trainers disagree is refused instead of applied."""
    from longboat.ps.server.state import RequestError, ServerState
    from longboat.ps.shared.wire import Message

    state = ServerState(0, 1)
    sgd = {"key": "k", "update": "optimizer", "optimizer": "sgd", "hparams": {"lr": 1.0}}
    state.init(Message({"trainers": 2, "sync": True, "blocks": [sgd]}, {"k": torch.zeros(3)}))
    state.push(Message({"trainer": 0, "step": 0, "lrs": [0.1]}, {"k": torch.ones(3)}))
    with pytest.raises(RequestError, match="trainer 1 pushed with learning rate 0.2, trainer 0"):
        state.push(Message({"trainer": 1, "step": 0, "lrs": [0.2]}, {"k": torch.ones(3)}))
    state.push(Message({"trainer": 1, "step": 0, "lrs": [0.1]}, {"k": torch.ones(3)}))
    assert torch.allclose(state.blocks["k"].value, torch.full((3,), -0.1))  # 0 - 0.1 * mean
