"""longboat.kvstore with torch's sparse gradients (``nn.Embedding(sparse=True)``): pushed as
the rows they hold, like MXNet's row_sparse gradients, by a store and by ``kvstore.Trainer``."""

from __future__ import annotations

import pytest
import torch

import longboat.kvstore as kvstore
from tests.compat.test_kvstore_semantics import _on_workers


def _sparse_grad(rows: list[int], num: int = 4, dim: int = 2, scale: float = 1.0) -> torch.Tensor:
    """The gradient ``nn.Embedding(num, dim, sparse=True)`` gets from ``scale * emb(rows).sum()``."""
    emb = torch.nn.Embedding(num, dim, sparse=True)
    (scale * emb(torch.tensor(rows))).sum().backward()
    return emb.weight.grad


def test_a_sparse_torch_gradient_is_pushed_as_the_rows_it_holds():
    grad = _sparse_grad([1, 3, 1])
    assert grad.layout == torch.sparse_coo and not grad.is_coalesced()
    kv = kvstore.create("local")
    kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.1))
    kv.init(0, torch.ones(4, 2))
    kv.push(0, [grad, grad.to_dense()])  # one sparse and one dense "device": summed
    expected = torch.ones(4, 2) - 0.1 * 2 * grad.to_dense()
    torch.testing.assert_close(kv.pull(0), expected)
    out = kvstore.RowSparse.zeros((4, 2))
    kv.row_sparse_pull(0, out=out, row_ids=torch.tensor([3, 1]))
    assert out.indices.tolist() == [1, 3]
    kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    with pytest.raises(kvstore.InvalidArgumentError, match="lazy update"):
        kv.push(0, grad)  # a row-sparse gradient: MXNet's lazy-update refusal applies


def test_trainer_pushes_sparse_embedding_gradients_and_the_servers_sum_them():
    """gluon's sparse step: w -= lr * (sum over workers of each worker's rows)."""

    def body(kv):
        emb = torch.nn.Embedding(4, 2, sparse=True)
        with torch.no_grad():
            emb.weight.fill_(1.0 + kv.rank)  # worker 0's start wins
        trainer = kvstore.Trainer(emb.parameters(), torch.optim.SGD(emb.parameters(), lr=1.0), kv)
        ((kv.rank + 1) * emb(torch.tensor([kv.rank, 2]))).sum().backward()
        trainer.step(1)
        return trainer.update_on_kvstore, emb.weight.detach().clone()

    expected = torch.ones(4, 2)
    expected[0] -= 1.0
    expected[1] -= 2.0
    expected[2] -= 1.0 + 2.0
    for on_kvstore, weight in _on_workers("dist_sync", body):
        assert on_kvstore is True
        torch.testing.assert_close(weight, expected)


def test_update_on_kvstore_false_refuses_sparse_gradients_on_dist_and_keeps_them_local():
    def body(kv):
        emb = torch.nn.Embedding(4, 2, sparse=True)
        trainer = kvstore.Trainer(
            emb.parameters(), torch.optim.SGD(emb.parameters(), lr=1.0), kv, False
        )
        emb(torch.tensor([1])).sum().backward()
        with pytest.raises(ValueError) as info:
            trainer.step(1)
        return str(info.value)

    for message in _on_workers("dist_sync", body):
        assert message.startswith(
            "Cannot set update_on_kvstore=False on dist kvstore when sparse gradients are present."
        )
        assert "parameter(s) [0]" in message
    emb = torch.nn.Embedding(4, 2, sparse=True)
    start = emb.weight.detach().clone()
    opt = torch.optim.SparseAdam(emb.parameters(), lr=0.1)  # needs its gradients sparse
    trainer = kvstore.Trainer(emb.parameters(), opt, kvstore.create("local"), False)
    emb(torch.tensor([1, 1, 3])).sum().backward()
    trainer.step(1)
    assert emb.weight.grad.layout == torch.sparse_coo
    moved = (emb.weight.detach() != start).any(dim=1)
    assert moved.tolist() == [False, True, False, True]
