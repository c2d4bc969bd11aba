"""The PyTorch ImageNet flow (pytorch/examples imagenet/main.py), on scikit-learn's digits.

The same steps as the original: arguments, process group, model wrapped for data parallelism,
DistributedSampler + DataLoader, train / validate per epoch, checkpoint every epoch (resumed
from when the script runs again with the same ``--checkpoint``: the original's --resume). longboat
replaces the hand-wired pieces: ``lb.init()`` reads the rank, world size and rendezvous that
the launcher exported (instead of --world-size/--rank/--dist-url), ``lb.distribute`` is the
DDP wrapper, ``lb.DistributedSampler`` gives every rank the same number of batches.

    longboat launch --nproc-per-node 2 examples/ddp_digits.py --epochs 5
    python examples/ddp_digits.py --epochs 5        # the same script on one process
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import longboat as lb


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="data-parallel training on digits")
    p.add_argument("--epochs", default=5, type=int)
    p.add_argument("-b", "--batch-size", default=64, type=int, help="global batch size")
    p.add_argument("--lr", default=0.05, type=float)
    p.add_argument("--momentum", default=0.9, type=float)
    p.add_argument("--seed", default=0, type=int)
    p.add_argument(
        "--checkpoint", default="checkpoint.pt", help="written every epoch; resumed from if present"
    )
    p.add_argument("--dist-backend", default=None, help="gloo or nccl (default: by device)")
    return p.parse_args()


def load_digits() -> tuple[TensorDataset, TensorDataset]:
    from sklearn.datasets import load_digits as sk_digits

    digits = sk_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    split = int(len(x) * 0.8)
    mean, std = x[:split].mean(), x[:split].std()
    x = (x - mean) / std
    return TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:])


class Net(nn.Module):
    """A small convnet for 1x8x8 images."""

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


def train(loader: DataLoader, model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    model.train()
    total, count = 0.0, 0
    for images, target in loader:
        loss = F.cross_entropy(model(images), target)
        optimizer.zero_grad()
        loss.backward()  # gradients are averaged across ranks while backward runs
        optimizer.step()
        total, count = total + loss.item() * len(target), count + len(target)
    return total / max(count, 1)


def validate(loader: DataLoader, model: nn.Module) -> float:
    """Accuracy over the whole validation set (every rank evaluates all of it)."""
    model.eval()
    correct = 0
    with torch.no_grad():
        for images, target in loader:
            correct += int((model(images).argmax(1) == target).sum())
    return correct / len(loader.dataset)  # type: ignore[arg-type]


def main() -> None:
    args = parse_args()
    info = lb.init(backend=args.dist_backend)  # was dist.init_process_group(backend, url, ...)
    torch.manual_seed(args.seed)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    model, optimizer = lb.distribute(model, optimizer)  # was DistributedDataParallel(model)

    train_set, val_set = load_digits()
    sampler = lb.DistributedSampler(train_set, shuffle=True, seed=args.seed)
    per_rank = max(1, args.batch_size // info.world_size)
    train_loader = DataLoader(train_set, batch_size=per_rank, sampler=sampler)
    val_loader = DataLoader(val_set, batch_size=256)

    start = 0
    state = lb.load_checkpoint(args.checkpoint)  # None on a fresh start
    if state is not None:  # run again with the same --checkpoint: go on where it stopped
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["epoch"] + 1
        if info.rank == 0:
            print(f"resumed from {args.checkpoint} after epoch {state['epoch']}", flush=True)
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        loss = train(train_loader, model, optimizer)
        accuracy = validate(val_loader, model)
        if info.rank == 0:
            print(f"epoch {epoch}: train loss {loss:.4f}  val accuracy {accuracy:.4f}", flush=True)
        lb.save_checkpoint(
            args.checkpoint,
            {
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "epoch": epoch,
            },
        )
    lb.shutdown()


if __name__ == "__main__":
    main()
