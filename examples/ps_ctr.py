"""Click-through-rate style training on parameter servers: two sparse tables, ids up to 10**6.

    longboat launch --servers 2 --workers 2 examples/ps_ctr.py --steps 200   # real processes
    python examples/ps_ctr.py --steps 60                                     # one process

A user table and an item table (1,000,000 rows each) live on the servers, sharded by row id;
each batch pulls only the rows it uses and pushes row-sparse gradients (Adagrad on the
servers). The dense tower trains with Adam on the servers. Run alone, the script starts two
servers as threads of its own process and trains one trainer. It prints the loss every 20
steps and exits with status 1 if the loss did not fall.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

import longboat as lb

ROWS = 1_000_000
DIM = 8


class CTRModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.users = lb.ps.SparseEmbedding(ROWS, DIM, "users", optimizer="adagrad", lr=0.5)
        self.items = lb.ps.SparseEmbedding(ROWS, DIM, "items", optimizer="adagrad", lr=0.5)
        self.tower = nn.Sequential(nn.Linear(2 * DIM, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        return self.tower(torch.cat([self.users(users), self.items(items)], 1)).squeeze(1)


def batch(step: int, trainer: int, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Synthetic clicks: 1,000 active users and items spread over [0, 10**6); a click unless
    both the user and the item have a hidden "dislike" bit."""
    g = torch.Generator().manual_seed(step * 1000 + trainer)
    users = (torch.randint(0, 1000, (size,), generator=g) * 997 + 17) % ROWS
    items = (torch.randint(0, 1000, (size,), generator=g) * 991 + 5) % ROWS
    likes = ((users * 2654435761) >> 7) % 2 + ((items * 40503) >> 5) % 2  # hidden, per id
    return users, items, (likes >= 1).float()


@contextlib.contextmanager
def local_servers() -> Iterator[tuple[list[str], str]]:
    """Two servers in this process (when not started by `longboat launch`)."""
    from longboat.ps.server import Server

    token = lb.ps.generate_token()
    started = [Server(index=i, num_servers=2, token=token).start() for i in range(2)]
    try:
        yield [s.endpoint for s in started], token
    finally:
        for s in started:
            s.stop(0)


def train(steps: int, batch_size: int, **where: object) -> list[float]:
    model = CTRModel()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    strategy = lb.Strategy(mode="ps", a_sync=False)
    if where:  # servers given explicitly (not from the launcher's environment)
        m, opt = lb.ps.distribute(model, opt, strategy, **where)
    else:
        m, opt = lb.distribute(model, opt, strategy)
    trainer = m.engine.trainer
    losses = []
    for step in range(steps):
        users, items, clicks = batch(step, trainer, batch_size)
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(m(users, items), clicks)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 20 == 0 or step == steps - 1:
            print(f"trainer {trainer} step {step:4d} loss {loss.item():.4f}", flush=True)
    m.engine.close()
    return losses


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=256)
    a = p.parse_args()
    torch.manual_seed(0)
    if lb.is_server():
        lb.ps.run_server()
        return 0
    if os.environ.get("PADDLE_PSERVERS_IP_PORT_LIST"):
        losses = train(a.steps, a.batch_size)
    else:
        with local_servers() as (servers, token):
            losses = train(a.steps, a.batch_size, servers=servers, trainer=0, trainers=1,
                           token=token)  # fmt: skip
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    print(f"mean loss of the first 10 steps {first:.4f}, of the last 10 {last:.4f}")
    return 0 if last < first else 1


if __name__ == "__main__":
    sys.exit(main())
