"""longboat.kvstore: MXNet's KVStore semantics on the in-process store and on real parameter
servers (2 workers as threads), each checked against arithmetic done by hand or by torch."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

import longboat.kvstore as kvstore
from tests.ps._harness import servers


def _grads(step: int, worker: int) -> torch.Tensor:
    return torch.randn(6, 3, generator=torch.Generator().manual_seed(10 * step + worker))


def _on_workers(eps: list[str], token: str, kind: str, body: Callable[[Any], Any]) -> list[Any]:
    """``body(store)`` on 2 dist workers in parallel threads; the stores are closed after."""
    stores = [
        kvstore.create(kind, servers=eps, token=token, rank=r, num_workers=2, timeout=30)
        for r in range(2)
    ]
    try:
        with ThreadPoolExecutor(2) as pool:
            return list(pool.map(body, stores))
    finally:
        for s in stores:
            s.close()


def test_local_push_sums_device_lists_and_pull_fills_every_output():
    kv = kvstore.create("local")
    assert (kv.type, kv.rank, kv.num_workers, kv.update_on_kvstore) == ("local", 0, 1, False)
    kv.init(3, torch.ones(2, 3))
    kv.push(3, [torch.full((2, 3), 2.0), torch.full((2, 3), 5.0)])  # two "devices"
    outs = [torch.empty(2, 3), torch.empty(2, 3)]
    kv.pull(3, out=outs)
    assert all(torch.equal(o, torch.full((2, 3), 7.0)) for o in outs)
    kv = kvstore.create("local")  # a store takes int or str keys, not both (MXNet's rule)
    kv.init(["a", "b"], [torch.zeros(4), torch.zeros(5)])
    kv.push(["a", "b"], [torch.ones(4), [torch.ones(5), torch.ones(5)]])
    a, b = kv.pull(["a", "b"])
    assert torch.equal(a, torch.ones(4)) and torch.equal(b, torch.full((5,), 2.0))
    value = torch.full((4,), 3.0)
    kv.pushpull("a", value)  # without out: the result lands in value
    assert torch.equal(value, torch.full((4,), 3.0)) and torch.equal(kv.pull("a"), value)


def test_local_optimizer_equals_torch_sgd_with_momentum_rescale_and_wd():
    start = torch.randn(6, 3, generator=torch.Generator().manual_seed(0))
    kv = kvstore.create("device")
    kv.init(0, start)  # set_optimizer after init reconfigures the existing key
    kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=0.01,
                                           rescale_grad=0.5))  # fmt: skip
    assert kv.update_on_kvstore
    ref = start.clone().requires_grad_(True)
    torch_sgd = torch.optim.SGD([ref], lr=0.1, momentum=0.9, weight_decay=0.01)
    for step in range(4):
        kv.push(0, _grads(step, 0))
        ref.grad = _grads(step, 0) * 0.5
        torch_sgd.step()
    torch.testing.assert_close(kv.pull(0), ref.detach(), rtol=1e-6, atol=1e-6)


def test_torch_optimizer_accepted_and_set_before_init():
    kv = kvstore.create("local")
    w = torch.zeros(3, requires_grad=True)
    kv.set_optimizer(torch.optim.Adam([w], lr=0.05))
    kv.init("w", torch.zeros(3))
    ref = torch.zeros(3, requires_grad=True)
    adam = torch.optim.Adam([ref], lr=0.05)
    for step in range(3):
        g = torch.tensor([1.0, -2.0, 0.5]) * (step + 1)
        kv.push("w", g)
        ref.grad = g
        adam.step()
    torch.testing.assert_close(kv.pull("w"), ref.detach())


def test_local_updater_changes_stored_in_place():
    kv = kvstore.create("local")
    seen = []

    def updater(key, pushed, stored):
        seen.append(key)
        stored += 2 * pushed

    kv.set_updater(updater)
    kv.init(7, torch.ones(3))
    kv.push(7, torch.ones(3))
    assert seen == [7] and torch.equal(kv.pull(7), torch.full((3,), 3.0))


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="dist_sync"):
        kvstore.create("dist_sink")
    kv = kvstore.create("local")
    with pytest.raises(KeyError, match="init"):
        kv.pull(1)
    kv.init(1, torch.zeros(2, 2))
    with pytest.raises(ValueError, match="shape"):
        kv.push(1, torch.zeros(3))
    with pytest.raises(ValueError, match="differ in shape"):
        kv.push(1, [torch.zeros(2, 2), torch.zeros(2)])
    kv.push([1, 1], [torch.ones(2, 2), torch.ones(2, 2)])  # MXNet groups a key's values: sum
    assert torch.equal(kv.pull(1), torch.full((2, 2), 2.0))
    with pytest.raises(ValueError, match="out has shape"):
        kv.pull(1, out=torch.empty(4))
    with pytest.raises(TypeError, match="SGD"):
        kv.set_optimizer("sgd")
    with pytest.raises(ValueError, match="unknown optimizer"):
        kvstore.optimizer.create("lamb")


def test_dist_sync_sums_workers_pushes_like_mxnet():
    with servers(2) as (eps, token):

        def body(kv):
            kv.init("g", torch.full((6, 3), float(kv.rank + 100)))  # worker 0's value wins
            first = kv.pull("g")
            kv.push("g", _grads(0, kv.rank))
            return first, kv.pull("g")

        (first0, summed0), (first1, summed1) = _on_workers(eps, token, "dist_sync", body)
    assert torch.equal(first0, torch.full((6, 3), 100.0)) and torch.equal(first1, first0)
    expected = _grads(0, 0) + _grads(0, 1)
    torch.testing.assert_close(summed0, expected)
    assert torch.equal(summed0, summed1)


def test_dist_sync_optimizer_on_servers_equals_local_store_on_the_summed_gradient():
    start = torch.randn(6, 3, generator=torch.Generator().manual_seed(1))
    opt = kvstore.optimizer.SGD(learning_rate=0.2, momentum=0.9, rescale_grad=0.25)
    with servers(2) as (eps, token):

        def body(kv):
            kv.init(0, start)
            kv.set_optimizer(opt)  # after init: worker 0 reconfigures, then a barrier
            for step in range(3):
                kv.push(0, _grads(step, kv.rank))
            return kv.pull(0)

        dist = _on_workers(eps, token, "dist_device_sync", body)
    local = kvstore.create("local")
    local.init(0, start)
    local.set_optimizer(opt)
    for step in range(3):
        local.push(0, [_grads(step, 0), _grads(step, 1)])  # the global batch, one process
    torch.testing.assert_close(dist[0], local.pull(0), rtol=1e-5, atol=1e-6)
    assert torch.equal(dist[0], dist[1])


def test_dist_async_applies_every_push():
    start = torch.zeros(6, 3)
    with servers(1) as (eps, token):

        def body(kv):
            kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.1))
            kv.init(0, start)
            for step in range(5):
                kv.push(0, _grads(step, kv.rank))
            kv.barrier()
            return kv.pull(0)

        pulled = _on_workers(eps, token, "dist_async", body)
    total = sum(_grads(s, r) for s in range(5) for r in range(2))
    torch.testing.assert_close(pulled[0], start - 0.1 * total, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="set_optimizer"), servers(1) as (eps, token):
        kv = kvstore.create("dist_sync", servers=eps, token=token, rank=0, num_workers=1)
        try:
            kv.set_updater(lambda *_: None)
        finally:
            kv.close()


@pytest.mark.parametrize("update_on_kvstore", [True, False])
def test_trainer_on_two_workers_equals_single_process_training(update_on_kvstore):
    """gluon.Trainer's two modes: servers update, or servers only sum gradients."""
    x = torch.randn(32, 5, generator=torch.Generator().manual_seed(2))
    y = x @ torch.arange(5.0) + 1.0

    def train(kv, rank: int, world: int) -> torch.Tensor:
        model = torch.nn.Linear(5, 1)
        g = torch.Generator().manual_seed(rank)  # different starts: worker 0's values must win
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
        trainer = kvstore.Trainer(model.parameters(), opt, kv, update_on_kvstore)
        for _ in range(6):
            trainer.zero_grad()
            xs, ys = x[rank::world], y[rank::world]
            ((model(xs).squeeze(1) - ys) ** 2).sum().backward()
            trainer.step(batch_size=len(x))  # gluon: the workers' sum / the global batch
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    with servers(2) as (eps, token):
        dist = _on_workers(eps, token, "dist_sync", lambda kv: train(kv, kv.rank, 2))
    single = train(kvstore.create("local"), 0, 1)
    torch.testing.assert_close(dist[0], single, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dist[1], single, rtol=1e-5, atol=1e-6)
