"""Paddle's Fleet collective example (the paddlepaddle.org.cn demo), in PyTorch on longboat.fleet.

The four differences from single-process code that the original marks (区别1-4) are marked here
too: the import, the strategy and role maker, the wrapped optimizer, and saving.

    longboat launch --nproc-per-node 2 examples/fleet_collective.py --steps 100
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from torch import nn

# 区别1 (difference 1): import the distributed training library
import longboat.fleet as fleet
from longboat.fleet import DistributedStrategy, role_maker


def mlp(hid_dim: int = 1280, label_dim: int = 2) -> nn.Module:
    """The original's network: two tanh layers and a softmax classifier (softmax in the loss)."""
    return nn.Sequential(
        nn.Linear(32, hid_dim),
        nn.Tanh(),
        nn.Linear(hid_dim, hid_dim),
        nn.Tanh(),
        nn.Linear(hid_dim, label_dim),
    )


def gen_data(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The original's random batch: 128 samples of 32 features, binary labels."""
    return {
        "x": rng.random(size=(128, 32)).astype("float32"),
        "y": rng.integers(2, size=(128, 1)).astype("int64"),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--hid-dim", type=int, default=1280)
    p.add_argument("--model-path", default="./fleet_model")
    args = p.parse_args()

    # 区别2 (difference 2): the training strategy and the cluster's roles
    dist_strategy = DistributedStrategy()
    role = role_maker.PaddleCloudRoleMaker(is_collective=True)
    fleet.init(role)
    # the Paddle original reads FLAGS_selected_gpus; fleet.init already pinned this rank's GPU
    device = (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    )
    print(f"worker {fleet.worker_index()} of {fleet.worker_num()} on {device}")

    torch.manual_seed(0)
    model = mlp(args.hid_dim).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    # 区别3 (difference 3): wrap the optimizer; minimize() runs backward and the synced step
    optimizer = fleet.distributed_optimizer(optimizer, strategy=dist_strategy)
    model = fleet.distributed_model(model)

    rng = np.random.default_rng(fleet.worker_index())  # each worker reads its own batches
    loss_fn = nn.CrossEntropyLoss()
    for i in range(args.steps):
        batch = gen_data(rng)
        x = torch.from_numpy(batch["x"]).to(device)
        y = torch.from_numpy(batch["y"]).squeeze(1).to(device)
        cost = loss_fn(model(x), y)
        optimizer.minimize(cost)
        if fleet.is_first_worker() and i % 10 == 0:
            print(f"step{i} cost={cost.item():f}")

    # 区别4 (difference 4): save the model (the first worker writes, atomically)
    path = fleet.save_persistables(None, args.model_path)
    fleet.barrier_worker()
    if fleet.is_first_worker():
        print(f"saved {path}")


if __name__ == "__main__":
    main()
