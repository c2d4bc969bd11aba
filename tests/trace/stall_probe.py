"""A 2-rank job in which rank 1 sleeps before its backward in step 2 (the stall).

python -m longboat launch --nproc-per-node 2 tests/trace/stall_probe.py SLEEP [WARN SHUTDOWN]

Without WARN and SHUTDOWN the strategy keeps its defaults. Called in-process, ``hold`` replaces
the sleep (a wait that ends on an event, e.g. once rank 0 has warned).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F


def train(
    sleep_s: float,
    warning_s: float | None = None,
    shutdown_s: float | None = None,
    hold: Callable[[], None] | None = None,
) -> None:
    import longboat as lb

    strategy = lb.Strategy()
    if warning_s is not None:
        strategy.update(stall_warning_seconds=warning_s, stall_shutdown_seconds=shutdown_s)
    lb.init(strategy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    model, opt = lb.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    for step in range(3):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if step == 1 and lb.rank() == 1:
            if hold is not None:
                hold()  # rank 0 waits in the allreduce meanwhile
            else:
                time.sleep(sleep_s)
        loss.backward()
        opt.step()


if __name__ == "__main__":
    train(*(float(a) for a in sys.argv[1:4]))
