"""The pieces of `longboat demo`: data, model, one rank's training, and the single-process reference.

Everything here is deterministic given the seed, so the distributed run can be replayed in one
process: same initial weights, same global batches (each the concatenation of the ranks' batches
in rank order), same optimizer.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from longboat.tools.progress import progress

TEST_FRACTION = 0.2


@dataclass(frozen=True)
class DemoConfig:
    """What every rank and the reference need to train the same way."""

    nproc: int
    epochs: int
    global_batch: int
    lr: float
    momentum: float
    seed: int
    method: str = "baseline"  # a key of longboat.tools.demo_methods.METHODS

    @property
    def rank_batch(self) -> int:
        return self.global_batch // self.nproc


def load_digits_split() -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's bundled 8x8 digits as (train, test): the last 20% is the test set.

    Images are scaled to [0, 1] and standardised with the training set's mean and std.
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    split = len(x) - round(len(x) * TEST_FRACTION)
    mean, std = x[:split].mean(), x[:split].std()
    x = (x - mean) / std
    return TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:])


class DigitsNet(nn.Module):
    """Two 3x3 convolutions, one 2x2 pooling, two linear layers: 1x8x8 -> 10 logits."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def build_model(seed: int) -> DigitsNet:
    """A DigitsNet whose initial weights depend only on ``seed`` (global RNG left untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return DigitsNet()


def build_optimizer(model: nn.Module, cfg: DemoConfig) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)


def make_sampler(
    dataset: TensorDataset,
    cfg: DemoConfig,
    num_replicas: int | None = None,
    rank: int | None = None,
) -> Any:
    """The demo's sampler; rank and world size come from the cluster unless given."""
    import longboat as lb

    return lb.DistributedSampler(
        dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=cfg.seed
    )


def global_batches(dataset: TensorDataset, cfg: DemoConfig, epoch: int) -> list[list[int]]:
    """One epoch's global batches: step i is rank 0's i-th batch + rank 1's i-th batch + ..."""
    per_rank = []
    for rank in range(cfg.nproc):
        sampler = make_sampler(dataset, cfg, num_replicas=cfg.nproc, rank=rank)
        sampler.set_epoch(epoch)
        per_rank.append(list(sampler))
    b = cfg.rank_batch
    steps = -(-len(per_rank[0]) // b)
    return [sum((idx[i * b : (i + 1) * b] for idx in per_rank), []) for i in range(steps)]


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> float:
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.item()


@torch.no_grad()
def accuracy(model: nn.Module, dataset: TensorDataset) -> float:
    """Fraction of ``dataset`` that ``model`` classifies correctly."""
    model.eval()
    x, y = dataset.tensors
    correct = (model(x).argmax(dim=1) == y).sum().item()
    model.train()
    return correct / len(y)


def parameters_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def train_rank(cfg: DemoConfig) -> dict[str, Any]:
    """One rank of the demo (run through `launch_local`); returns its results to the launcher.

    Keys: params, losses (per step, this rank's batch), samples (this rank), seconds (training
    loop), samples_per_s (global), backend, bytes_per_step (gradient bytes this rank sent, on
    average), last_step_bytes, and on rank 0 the test accuracy.
    """
    import torch.distributed as dist

    import longboat as lb
    from longboat.tools.demo_methods import strategy_for

    lb.init()
    torch.set_num_threads(1)
    try:
        train, test = load_digits_split()
        model = build_model(cfg.seed)
        model, optimizer = lb.distribute(
            model, build_optimizer(model, cfg), strategy_for(cfg.method)
        )
        sampler = make_sampler(train, cfg)
        loader = DataLoader(train, batch_size=cfg.rank_batch, sampler=sampler)
        losses: list[float] = []
        sent: list[int] = []  # cumulative gradient bytes after each step
        start = time.perf_counter()
        steps = cfg.epochs * len(loader)
        with progress(
            "rank 0 train", steps, lb.rank() == 0, epoch=f"1/{cfg.epochs}", loss="-"
        ) as advance:
            for epoch in range(cfg.epochs):
                sampler.set_epoch(epoch)
                for x, y in loader:
                    losses.append(train_step(model, optimizer, x, y))
                    sent.append(model.bytes_sent())
                    advance(epoch=f"{epoch + 1}/{cfg.epochs}", loss=losses[-1])
        seconds = time.perf_counter() - start
        samples = cfg.epochs * len(sampler)
        model.settle_parameters()  # sharding leaves the last step's gathers to a next forward
        return {
            "bytes_per_step": sent[-1] / len(sent) if sent else 0.0,
            "last_step_bytes": sent[-1] - sent[-2] if len(sent) > 1 else 0,
            "params": parameters_of(model.module),
            "losses": losses,
            "samples": samples,
            "seconds": seconds,
            "samples_per_s": samples * lb.world_size() / seconds,
            "backend": str(dist.get_backend()),
            "accuracy": accuracy(model.module, test) if lb.rank() == 0 else None,
        }
    finally:
        lb.shutdown()


def train_reference(cfg: DemoConfig, train: TensorDataset) -> dict[str, Any]:
    """Train the same model in this process on the same global batches, one thread."""
    model = build_model(cfg.seed)
    optimizer = build_optimizer(model, cfg)
    x_all, y_all = train.tensors
    losses: list[float] = []
    samples = 0
    with _threads(1):
        start = time.perf_counter()
        for epoch in range(cfg.epochs):
            for batch in global_batches(train, cfg, epoch):
                idx = torch.tensor(batch)
                losses.append(train_step(model, optimizer, x_all[idx], y_all[idx]))
                samples += len(batch)
        seconds = time.perf_counter() - start
    return {
        "params": parameters_of(model),
        "losses": losses,
        "seconds": seconds,
        "samples_per_s": samples / seconds,
    }


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` intra-op threads, like each rank."""
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)
