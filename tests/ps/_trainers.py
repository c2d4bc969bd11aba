"""Trainer bodies run in spawned processes by the parameter-server tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import longboat as lb
from longboat.ps.trainer.sparse import SparseEmbedding
from tests.collective import _workloads as W

VOCAB, DIM = 1000, 8


def dense_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-3)
    # a non-zero start of the squared-gradient sum: with 0, a gradient that is 0 in one
    # summation order and 1e-9 in another moves the weight by a whole lr (ill-conditioned)
    return torch.optim.Adagrad(model.parameters(), lr=0.05, initial_accumulator_value=0.1)


def ps_strategy(**fields: Any) -> lb.Strategy:
    return lb.Strategy(mode="ps", **fields)


def run_each(rank: int, world: int, fn_name: str, jobs: list[tuple[Any, ...]]) -> list[Any]:
    """Run ``fn_name(rank, world, *job)`` for every job in turn (one spawn for many cases)."""
    return [globals()[fn_name](rank, world, *job) for job in jobs]


def train_dense(
    rank: int,
    world: int,
    eps: list[str],
    token: str,
    opt_name: str,
    on_server: bool,
    overlap: bool,
    overrides: dict[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """STEPS sync steps of the collective tests' MixedNet on this trainer's shard."""
    cfg = W.Config(optimizer="adam" if opt_name == "adam" else "sgd")
    model = W.build_model(cfg, seed=0)
    strategy = ps_strategy(a_sync=False, a_sync_configs={"update_on_server": on_server})
    m, opt = lb.ps.distribute(
        model,
        dense_optimizer(opt_name, model),
        strategy,
        servers=eps,
        trainer=rank,
        trainers=world,
        token=token,
        overlap=overlap,
        **(overrides or {}),
    )
    x, y = W.data(cfg)
    for i in range(W.STEPS):
        opt.zero_grad()
        F.cross_entropy(m(W.shard(x[i], rank, world)), W.shard(y[i], rank, world)).backward()
        opt.step()
    state = model.state_dict()  # waits for the last pull (with overlap it is still in flight)
    params = {name: state[name].clone() for name, _ in model.named_parameters()}
    m.engine.close()
    return params


class SparseNet(nn.Module):
    """Bag-of-ids classifier: a server-side table (or a local reference table) + a linear head."""

    def __init__(self, table: nn.Module) -> None:
        super().__init__()
        self.table = table
        torch.manual_seed(1)
        self.head = nn.Linear(DIM, W.CLASSES).to(torch.float64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(ids).mean(1))


def sparse_table(opt_name: str) -> SparseEmbedding:
    lr = 1e-2 if opt_name == "adam" else 0.1
    return SparseEmbedding(
        VOCAB, DIM, "emb", optimizer=opt_name, lr=lr, seed=3, dtype=torch.float64
    )


def sparse_data() -> tuple[torch.Tensor, torch.Tensor]:
    """Ids with many duplicates (within and across trainers) and labels, per step."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 40, (W.STEPS, W.GLOBAL_BATCH, 5), generator=g) * 23 % VOCAB
    return ids, torch.randint(0, W.CLASSES, (W.STEPS, W.GLOBAL_BATCH), generator=g)


def train_sparse(
    rank: int, world: int, eps: list[str], token: str, opt_name: str
) -> dict[str, torch.Tensor]:
    table = sparse_table(opt_name)
    model = SparseNet(table)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    m, opt = lb.ps.distribute(
        model,
        opt,
        ps_strategy(a_sync=False),
        servers=eps,
        trainer=rank,
        trainers=world,
        token=token,
    )
    ids, y = sparse_data()
    for i in range(W.STEPS):
        opt.zero_grad()
        loss = F.cross_entropy(m(W.shard(ids[i], rank, world)), W.shard(y[i], rank, world))
        loss.backward()
        opt.step()
    with torch.no_grad():
        rows = table(torch.arange(VOCAB))
    m.engine.close()
    return {
        "head.weight": model.head.weight.detach().clone(),
        "head.bias": model.head.bias.detach().clone(),
        "table": rows,
    }


def sparse_reference(opt_name: str, world: int) -> dict[str, torch.Tensor]:
    spec = sparse_table(opt_name)
    emb = nn.Embedding(VOCAB, DIM, sparse=opt_name == "adam", dtype=torch.float64)
    with torch.no_grad():
        emb.weight.copy_(spec.initial_weight())
    model = SparseNet(emb)
    lr = spec.hparams["lr"]
    table_opt: torch.optim.Optimizer = {
        "sgd": lambda: torch.optim.SGD([emb.weight], lr=lr),
        "adagrad": lambda: torch.optim.Adagrad([emb.weight], lr=lr),
        "adam": lambda: torch.optim.SparseAdam([emb.weight], lr=lr),
    }[opt_name]()
    head_opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    ids, y = sparse_data()
    for i in range(W.STEPS):
        table_opt.zero_grad()
        head_opt.zero_grad()
        losses = [
            F.cross_entropy(model(W.shard(ids[i], r, world)), W.shard(y[i], r, world))
            for r in range(world)
        ]
        torch.stack(losses).mean().backward()
        table_opt.step()
        head_opt.step()
    return {
        "head.weight": model.head.weight.detach(),
        "head.bias": model.head.bias.detach(),
        "table": emb.weight.detach(),
    }


def digits_config(world: int, epochs: int) -> Any:
    """The demo's task with plain SGD: momentum 0.9 on gradients a step or two stale (async)
    diverges, so every mode is compared with lr 0.2 and no momentum."""
    from longboat.tools import demo_train as D

    return D.DemoConfig(nproc=world, epochs=epochs, global_batch=64, lr=0.2, momentum=0.0, seed=0)


def train_digits(
    rank: int, world: int, eps: list[str], token: str, fields: dict[str, Any], epochs: int
) -> float:
    """The demo's digits task in one parameter-server mode; the test accuracy at the end."""
    from torch.utils.data import DataLoader

    from longboat.tools import demo_train as D

    cfg = digits_config(world, epochs)
    train, test = D.load_digits_split()
    model = D.build_model(cfg.seed)
    m, opt = lb.ps.distribute(
        model,
        D.build_optimizer(model, cfg),
        ps_strategy(**fields),
        servers=eps,
        trainer=rank,
        trainers=world,
        token=token,
    )
    sampler = D.make_sampler(train, cfg, num_replicas=world, rank=rank)
    loader = DataLoader(train, batch_size=cfg.rank_batch, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            D.train_step(m, opt, x, y)
    m.engine.refresh()
    acc = D.accuracy(model, test)
    m.engine.close()
    return acc
