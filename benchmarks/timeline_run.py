"""The run behind docs/img/overlap.png: 10 steps of a 3.2 M-parameter MLP with the timeline on.

longboat launch --nproc-per-node 2 benchmarks/timeline_run.py trace.json
longboat timeline trace.json -o docs/img/overlap.png
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.nn import functional as F

import longboat as lb


def main(path: str) -> None:
    strategy = lb.Strategy(
        timeline=path, nccl_comm_num=2, fuse_grad_size_in_MB=2, sync_nccl_allreduce=False
    )
    lb.init(strategy)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    widths = [512, 1024, 1024, 1024, 10]
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:], strict=False):
        layers += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    model, opt = lb.distribute(model, torch.optim.SGD(model.parameters(), lr=0.01), strategy)
    batches = [(torch.randn(64, 512), torch.randint(0, 10, (64,))) for _ in range(10)]
    for x, y in lb.trace.data(batches):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "trace.json")
