"""MXNet's KVStore flow in PyTorch: a digits classifier trained through
``longboat.kvstore`` with gluon.Trainer's two server modes.

    longboat launch --servers 1 --workers 2 examples/kvstore_digits.py --kvstore dist_sync
    python examples/kvstore_digits.py --kvstore local          # one process, the same numbers

Every process runs this script: in the server, ``kvstore.create("dist_sync")`` serves until
the workers finish. Each worker takes its share of every global batch (MXNet's SplitSampler);
``--update-on-kvstore 1`` lets the servers run the optimizer, ``0`` has them only sum the
gradients, which each worker then applies itself. ``--save FILE`` writes the final weights
(worker 0) so runs can be compared.
"""

from __future__ import annotations

import argparse

import torch
from sklearn.datasets import load_digits
from torch import nn

import longboat.kvstore as kvstore


def data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's 8x8 digits scaled to [0, 1]: the first 1,500 to train, the rest to test."""
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    return x[:1500], y[:1500], x[1500:], y[1500:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kvstore", default="local", choices=kvstore.TYPES)
    p.add_argument("--update-on-kvstore", type=int, default=1, choices=(0, 1))
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=100, help="global batch (all workers)")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--save", default=None)
    args = p.parse_args()

    kv = kvstore.create(args.kvstore)  # a server process serves here and exits afterwards
    rank, workers = kv.rank, kv.num_workers
    x, y, x_test, y_test = data()

    torch.manual_seed(rank)  # different initial weights per worker: worker 0's are used
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    trainer = kvstore.Trainer(model.parameters(), opt, kv, bool(args.update_on_kvstore))
    loss_fn = nn.CrossEntropyLoss(reduction="sum")

    for epoch in range(args.epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        total = 0.0
        for start in range(0, len(x), args.batch_size):
            global_batch = order[start : start + args.batch_size]
            batch = global_batch[rank::workers]  # SplitSampler
            trainer.zero_grad()
            loss = loss_fn(model(x[batch]), y[batch])
            loss.backward()
            trainer.step(batch_size=len(global_batch))  # gluon: the workers' sum / batch_size
            total += loss.item()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        print(f"worker {rank}/{workers} epoch {epoch}: train loss {total / len(x) * workers:.4f}"
              f" test accuracy {accuracy:.3f}", flush=True)  # fmt: skip
    if args.save and rank == 0:
        torch.save({k: v.detach() for k, v in model.state_dict().items()}, args.save)
    kv.close()


if __name__ == "__main__":
    main()
