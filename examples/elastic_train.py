"""Elastic data-parallel training on scikit-learn's digits: nodes may leave and join.

The model, optimizer, sampler and epoch live in an ``lb.elastic.State``. Every optimizer step
ends with ``state.commit()`` (an in-memory snapshot). When a node dies, the surviving ranks go
back to their last commit, re-form the process group without it and go on; a node that joins
receives the state from a survivor. ``ElasticSampler`` keeps the epoch's progress across these
changes, so every training sample is used once per epoch. The learning rate follows the
number of ranks (a reset callback rescales it after every membership change).

    python examples/elastic_train.py --epochs 3                            # one process
    longboat launch --nproc-per-node 2 examples/elastic_train.py           # a fixed group
    longboat launch --nnodes 2:4 --master HOST:PORT examples/elastic_train.py   # elastic, on each node

On one machine, three emulated nodes of which one is killed at step 20 (run it as root):

    longboat emulate --nodes 3 --min-nodes 2 --kill-node 2@step=20 \\
        -- examples/elastic_train.py --step-delay 0.05
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import longboat as lb


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="elastic data-parallel training on digits")
    p.add_argument("--epochs", default=5, type=int)
    p.add_argument("-b", "--batch-size", default=32, type=int, help="samples per rank and step")
    p.add_argument("--lr", default=0.02, type=float, help="learning rate per rank")
    p.add_argument("--seed", default=0, type=int)
    p.add_argument("--checkpoint", default=None, help="also write the state here every epoch")
    p.add_argument("--step-delay", default=0.0, type=float, help="sleep per step (for demos)")
    return p.parse_args()


def load_digits() -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's 8x8 digits (shipped with it, no download), 80 % train, 20 % validation."""
    from sklearn.datasets import load_digits as sk_digits

    digits = sk_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    split = int(len(x) * 0.8)
    return TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:])


def validate(loader: DataLoader, model: nn.Module) -> float:
    """Accuracy over the whole validation set (every rank evaluates all of it)."""
    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in loader:
            correct += int((model(x).argmax(1) == y).sum())
    model.train()
    return correct / len(loader.dataset)  # type: ignore[arg-type]


def main() -> None:
    args = parse_args()
    lb.init()
    torch.manual_seed(args.seed)
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr * lb.world_size(), momentum=0.9)
    model, optimizer = lb.distribute(net, optimizer)

    train_set, val_set = load_digits()
    sampler = lb.elastic.ElasticSampler(train_set, args.batch_size, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_sampler=sampler)
    val_loader = DataLoader(val_set, batch_size=256)

    state = lb.elastic.State(
        model=model,
        optimizer=optimizer,
        sampler=sampler,
        checkpoint=args.checkpoint,
        epoch=0,
    )

    def scale_lr() -> None:
        """Keep the learning rate proportional to the global batch (batch size x ranks)."""
        for group in optimizer.param_groups:
            group["lr"] = args.lr * lb.world_size()

    state.register_reset_callbacks([scale_lr])
    if state.load_checkpoint():  # a restart of the whole job: go on from the file
        scale_lr()
        if lb.rank() == 0:
            print(f"resumed from {args.checkpoint} at epoch {state.epoch}", flush=True)

    @lb.elastic.run
    def train(state: lb.elastic.State) -> None:
        while state.epoch < args.epochs:
            sampler.set_epoch(state.epoch)  # the same epoch again keeps its progress
            for x, y in loader:
                loss = F.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                sampler.record_batch()
                if args.step_delay:
                    time.sleep(args.step_delay)
                state.commit()  # may raise MembershipChanged: lb.elastic.run handles it
            accuracy = validate(val_loader, model)
            if lb.rank() == 0:
                print(
                    f"epoch {state.epoch}: {lb.world_size()} ranks, {state.commits} steps "
                    f"committed, val accuracy {accuracy:.4f}",
                    flush=True,
                )
            state.epoch += 1
            state.write_checkpoint()  # rank 0, atomically; nothing without --checkpoint

    train(state)
    lb.shutdown()


if __name__ == "__main__":
    main()
