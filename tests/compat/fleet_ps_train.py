"""Run by `longboat launch --servers 2 --workers 2`: Paddle Fleet's parameter-server flow."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository (tests.*)

import longboat.fleet as fleet  # noqa: E402
from tests.collective import _workloads as W  # noqa: E402


def main(out: str, a_sync: bool) -> None:
    fleet.init()  # roles from the launcher's environment (TRAINING_ROLE, ...)
    strategy = fleet.DistributedStrategy()
    strategy.a_sync = a_sync
    if fleet.is_server():
        fleet.init_server()
        fleet.run_server()  # returns once both workers called stop_worker
        return
    torch.set_num_threads(1)
    rank, world = fleet.worker_index(), fleet.worker_num()
    cfg = W.Config()
    model = W.build_model(cfg, seed=0)
    optimizer = fleet.distributed_optimizer(W.build_optimizer(cfg, model), strategy)
    fleet.init_worker()
    dmodel = fleet.distributed_model(model)
    x, y = W.data(cfg)
    for i in range(W.STEPS):
        loss = F.cross_entropy(dmodel(W.shard(x[i], rank, world)), W.shard(y[i], rank, world))
        optimizer.minimize(loss)
    fleet.barrier_worker()
    if fleet.is_first_worker():
        fleet.save_persistables(None, out)
    torch.save(W.params_of(model), Path(out, f"trainer{rank}.pt"))
    fleet.stop_worker()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "async")
