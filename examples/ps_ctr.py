"""Click-through-rate training on parameter servers: 26 Zipf-distributed slots in one sparse
table of 840,543 rows, 13 dense features (longboat.data.ctr, longboat.models.ctr).

    longboat launch --servers 2 --workers 2 examples/ps_ctr.py --steps 200   # real processes
    python examples/ps_ctr.py --steps 60                                     # one process

The table (Criteo's 26 slot cardinalities capped at 100,000) lives on the servers, sharded by
row id; each batch pulls only the rows it uses and pushes row-sparse gradients (Adagrad on the
servers, per touched row). The dense tower trains with Adagrad on the servers. Each trainer
draws its own part of the global batch. Run alone, the script starts two servers as threads
of its own process and trains one trainer. It prints the loss every 20 steps and exits with
status 1 if the loss did not fall.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator

import torch.nn.functional as F

import longboat as lb
from longboat.data.ctr import CTRConfig, CTRData
from longboat.models.ctr import CTRModel, make_optimizer

CONFIG = CTRConfig()  # criteo_vocab(100_000): 840,543 rows
DIM = 8


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
    model = CTRModel(CONFIG, DIM, sparse=True, emb_lr=0.05)
    opt = make_optimizer(model, lr=0.02)
    strategy = lb.Strategy(mode="ps", a_sync=False)
    if where:  # servers given explicitly (not from the launcher's environment)
        m, opt = lb.ps.distribute(model, opt, strategy, **where)
    else:
        m, opt = lb.distribute(model, opt, strategy)
    trainer, trainers = m.engine.trainer, m.engine.trainers
    data = CTRData(CONFIG, batch_size, trainer, trainers)  # batch_size: the global batch
    losses = []
    for step, batch in zip(range(steps), data, strict=False):
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(m(batch.dense, batch.ids), batch.labels)
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
    p.add_argument("--batch-size", type=int, default=512, help="global batch")
    a = p.parse_args()
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
