"""The training job of `benchmarks/elastic_recovery.py` (one rank per emulated node).

BENCH_MODE=elastic: `lb.elastic` (in-memory commits, survivors go on).
BENCH_MODE=restart: what torchrun users do: rank 0 writes a checkpoint after every step
(temporary file + rename); after a failure torchrun restarts every rank, which loads it.
Each rank appends ``{"t", "step", "world", "pid"}`` per completed step to BENCH_DIR/steps.jsonl;
the rank of group rank BENCH_DIE_NODE writes BENCH_DIR/failure.json and kills (BENCH_FAULT=kill)
or freezes (freeze) its launcher and itself after step BENCH_DIE_STEP (a node lost as a whole).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist

import longboat as lb

MODE = os.environ.get("BENCH_MODE", "elastic")
OUT = Path(os.environ["BENCH_DIR"])
STEPS = int(os.environ.get("BENCH_STEPS", "16"))
DIE_NODE = int(os.environ.get("BENCH_DIE_NODE", "2"))
DIE_STEP = int(os.environ.get("BENCH_DIE_STEP", "6"))
FAULT = os.environ.get("BENCH_FAULT", "kill")
FREEZE_S = 90
WIDTH, DEPTH, BATCH = 2048, 6, 16  # 6 x (2048 x 2048 + 2048) = 25.2 M parameters


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def record(step: int) -> None:
    with open(OUT / "steps.jsonl", "a") as f:
        line = {"t": time.time(), "step": step, "world": dist.get_world_size(), "pid": os.getpid()}
        f.write(json.dumps(line) + "\n")


def maybe_die(step: int) -> None:
    """BENCH_FAULT=kill: the node's launcher and rank die (their sockets close at once);
    freeze: both stop (SIGSTOP) like a machine that froze or lost its link: nothing more is
    sent, not even a reset. A detached ``kill -9`` ends them FREEZE_S later."""
    if step == DIE_STEP and int(os.environ["GROUP_RANK"]) == DIE_NODE:
        (OUT / "failure.json").write_text(json.dumps({"t": time.time(), "step": step}))
        pids = (os.getppid(), os.getpid())
        if FAULT == "freeze":
            reaper = f"sleep {FREEZE_S}; kill -9 {pids[0]} {pids[1]}"
            subprocess.Popen(["sh", "-c", reaper], start_new_session=True)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP if FAULT == "freeze" else signal.SIGKILL)


def train_step(net: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(net(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def elastic() -> None:
    plain = model()
    optimizer = torch.optim.SGD(plain.parameters(), lr=1e-3, momentum=0.9)
    net, optimizer = lb.distribute(plain, optimizer)
    state = lb.elastic.State(model=net, optimizer=optimizer, step=0)

    @lb.elastic.run
    def train(state: lb.elastic.State) -> None:
        while state.step < STEPS:
            train_step(net, optimizer, state.step)
            state.step += 1
            state.commit()
            record(state.step)
            maybe_die(state.step)

    train(state)


def restart() -> None:
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
    dmodel, optimizer = lb.distribute(net, optimizer)
    path = OUT / "checkpoint.pt"
    step = 0
    if path.exists():
        saved = torch.load(path, weights_only=True)
        net.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        step = int(saved["step"])
    while step < STEPS:
        train_step(dmodel, optimizer, step)
        step += 1
        if dist.get_rank() == 0:
            tmp = OUT / ".checkpoint.pt.writing"
            torch.save(
                {"model": net.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp
            )
            os.replace(tmp, path)
        dist.barrier()  # the checkpoint is complete before any rank goes on
        record(step)
        maybe_die(step)


if __name__ == "__main__":
    lb.init()
    elastic() if MODE == "elastic" else restart()
    lb.shutdown()
