"""Run by `longboat launch --servers 2 --workers 2`: servers serve, trainers train (sync)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository (tests.*)

import longboat as lb  # noqa: E402
from longboat.ps.trainer.engine import cluster_from_env  # noqa: E402
from tests.collective import _workloads as W  # noqa: E402


def main(out: str) -> None:
    if lb.is_server():
        lb.ps.run_server()
        return
    torch.set_num_threads(1)
    _, rank, world = cluster_from_env()  # PADDLE_TRAINER_ID / PADDLE_TRAINERS_NUM
    train_and_save(out, rank, world)


def train_and_save(out: str, rank: int, world: int) -> None:
    """Trainer ``rank`` of ``world``: its shard of the shared workload's global batches, sync
    PS mode; the final parameters go to ``OUT/trainer<rank>.pt``."""
    cfg = W.Config()
    model = W.build_model(cfg, seed=0)
    m, opt = lb.distribute(
        model, W.build_optimizer(cfg, model), lb.Strategy(mode="ps", a_sync=False)
    )
    x, y = W.data(cfg)
    for i in range(W.STEPS):
        opt.zero_grad()
        F.cross_entropy(m(W.shard(x[i], rank, world)), W.shard(y[i], rank, world)).backward()
        opt.step()
    m.engine.close()
    torch.save(W.params_of(model), Path(out, f"trainer{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
