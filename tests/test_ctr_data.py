"""The synthetic CTR data (longboat.data.ctr) and the CTR model's two variants
(longboat.models.ctr): determinism, sharding, Zipf skew, learnable labels, equal training."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

import longboat as lb
from longboat.data.ctr import CTRConfig, CTRData, criteo_vocab
from longboat.models.ctr import CTRModel, make_optimizer

SMALL = CTRConfig(vocab=(50, 3, 2000, 700, 10, 5000), num_dense=5, seed=3)


def test_deterministic_from_seed() -> None:
    a, b = CTRData(SMALL, 64).batch(7), CTRData(SMALL, 64).batch(7)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    other = CTRData(CTRConfig(vocab=SMALL.vocab, num_dense=5, seed=4), 64).batch(7)
    assert not torch.equal(a.ids, other.ids)
    assert not torch.equal(a.ids, CTRData(SMALL, 64).batch(8).ids)


def test_shapes_ranges_and_disjoint_slots() -> None:
    batch = CTRData(SMALL, 512).batch(0)
    assert batch.dense.shape == (512, 5) and batch.dense.dtype == torch.float32
    assert batch.ids.shape == (512, 6) and batch.labels.shape == (512,)
    lo = SMALL.offsets
    hi = lo + torch.tensor(SMALL.vocab)
    assert bool(((batch.ids >= lo) & (batch.ids < hi)).all())
    assert set(batch.labels.unique().tolist()) == {0.0, 1.0}
    assert sum(criteo_vocab(10**6)) == 5_569_296 and len(criteo_vocab()) == 26


@pytest.mark.parametrize("trainers", [2, 3])
def test_shards_concatenate_to_the_global_batch(trainers: int) -> None:
    whole = CTRData(SMALL, 100).batch(5)
    parts = [CTRData(SMALL, 100, r, trainers).batch(5) for r in range(trainers)]
    for i, field in enumerate(whole):
        assert torch.equal(torch.cat([p[i] for p in parts]), field)


def test_zipf_head_ids_dominate() -> None:
    ids = CTRData(CTRConfig(vocab=(100_000,), num_dense=1), 50_000).batch(0).ids[:, 0]
    counts = ids.unique(return_counts=True)[1].sort(descending=True).values
    assert counts[0] > 100 * counts[len(counts) // 2]
    assert counts[:100].sum() > 0.3 * len(ids)  # 0.1 % of the ids: a third of the draws
    assert len(counts) > 5_000  # ... with a long tail


def test_labels_learnable_from_dense_features() -> None:
    data = CTRData(CTRConfig(vocab=(1000,) * 4, num_dense=8), 2048)
    train, held = data.batch(0), data.batch(1)
    base = held.labels.mean()
    entropy = F.binary_cross_entropy(base.expand_as(held.labels), held.labels)
    lin = torch.nn.Linear(8, 1)
    opt = torch.optim.LBFGS(lin.parameters(), max_iter=20)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(lin(train.dense).squeeze(1), train.labels)
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        held_loss = F.binary_cross_entropy_with_logits(lin(held.dense).squeeze(1), held.labels)
    assert held_loss < entropy - 0.05


def test_model_loss_falls() -> None:
    config = CTRConfig(vocab=(300,) * 8, num_dense=6)
    model = CTRModel(config, dim=8, sparse=False)
    opt = make_optimizer(model, lr=0.05)
    data, losses = CTRData(config, 512), []
    for _, batch in zip(range(60), data, strict=False):
        loss = F.binary_cross_entropy_with_logits(model(batch.dense, batch.ids), batch.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-10:]) < sum(losses[:10]) - 0.5  # mean loss down by > 0.05


@pytest.fixture
def servers() -> Iterator[tuple[list[str], str]]:
    from longboat.ps.server import Server

    token = lb.ps.generate_token()
    started = [Server(index=i, num_servers=2, token=token).start() for i in range(2)]
    yield [s.endpoint for s in started], token
    for s in started:
        s.stop(0)


def test_variants_start_equal_and_train_equal(servers: tuple[list[str], str]) -> None:
    endpoints, token = servers
    data = CTRData(SMALL, 128)
    dense = CTRModel(SMALL, dim=4, sparse=False, seed=5)
    sparse = CTRModel(SMALL, dim=4, sparse=True, seed=5)
    assert torch.equal(dense.table.weight, sparse.table.initial_weight())
    dense_opt = make_optimizer(dense, lr=0.05)
    ps, ps_opt = lb.ps.distribute(sparse, make_optimizer(sparse, lr=0.05),
                                  lb.Strategy(mode="ps", a_sync=False), servers=endpoints,
                                  trainer=0, trainers=1, token=token)  # fmt: skip
    try:
        batch = data.batch(0)
        torch.testing.assert_close(ps(batch.dense, batch.ids), dense(batch.dense, batch.ids))
        for step in range(3):
            batch = data.batch(step)
            for model, opt in ((dense, dense_opt), (ps, ps_opt)):
                opt.zero_grad()
                out = model(batch.dense, batch.ids)
                F.binary_cross_entropy_with_logits(out, batch.labels).backward()
                opt.step()
        batch = data.batch(3)
        torch.testing.assert_close(ps(batch.dense, batch.ids), dense(batch.dense, batch.ids))
        ps.engine.synchronize()
        for a, b in zip(sparse.tower_parameters(), dense.tower_parameters(), strict=True):
            torch.testing.assert_close(a, b)
    finally:
        ps.engine.close()
