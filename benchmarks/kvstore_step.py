"""Step time of ``longboat.kvstore.Trainer`` (MXNet KVStore style) next to ``lb.ps.distribute``
on the same model, servers and batch, measured in the same run.

    python benchmarks/kvstore_step.py --steps 60 --rounds 3

Each system trains a 20-layer MLP (41 parameter tensors, 0.33 M parameters: many keys, which
is what a per-key protocol pays for) on ``longboat launch --servers 2 --workers 2`` in sync
mode with momentum SGD: kvstore with the optimizer on the servers (``update_on_kvstore=True``)
and with servers that only sum (``False``), and lb.ps (pushes from backward hooks, overlap)
both ways (``a_sync_configs["update_on_server"]`` True, the default, and False). Reported:
the median over rounds of trainer 0's median step time after 10 warm-up steps, and each
kvstore setting's ratio to lb.ps with the optimizer in the same place. Systems alternate
within each round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

SYSTEMS = (
    "kvstore update_on_kvstore=True",
    "kvstore update_on_kvstore=False",
    "lb.ps (update_on_server=True)",
    "lb.ps update_on_server=False",
)
SAME_PLACE = {0: 2, 1: 3, 2: 2, 3: 3}  # each system's lb.ps counterpart
WARMUP = 10


def build_model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(20):
        layers += [nn.Linear(128, 128), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(128, 10))


def rank_main(out: str, system: int, steps: int) -> None:
    """One process under `longboat launch --servers 2 --workers 2`."""
    import longboat as lb
    import longboat.kvstore as kvstore

    torch.set_num_threads(1)
    if system < 2:
        kv = kvstore.create("dist_sync")  # a server process serves here and exits
        model = build_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        trainer = kvstore.Trainer(model.parameters(), opt, kv, update_on_kvstore=system == 0)
        rank, world, run, zero = kv.rank, kv.num_workers, model, trainer.zero_grad

        def update() -> None:
            trainer.step(1)
    else:
        if lb.is_server():
            lb.ps.run_server()
            return
        model = build_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        configs = {"update_on_server": system == 2}
        strategy = lb.Strategy(mode="ps", a_sync=False, a_sync_configs=configs)
        run, popt = lb.distribute(model, opt, strategy)
        rank, world, zero, update = (
            run.engine.trainer,
            run.engine.trainers,
            popt.zero_grad,
            popt.step,
        )
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32 // world, 128, generator=gen), torch.randint(0, 10, (32 // world,))
    times = []
    for _ in range(WARMUP + steps):
        start = time.perf_counter()
        zero()
        F.cross_entropy(run(x), y).backward()
        update()
        times.append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(json.dumps(statistics.median(times[WARMUP:])))
    if system >= 2:
        run.engine.close()


def launch(system: int, steps: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "median.json")
        cmd = [sys.executable, "-m", "longboat", "launch", "--servers", "2", "--workers", "2",
               "--log-dir", str(Path(tmp, "log")), __file__, "--rank", str(out),
               "--system", str(system), "--steps", str(steps)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0 or not out.exists():
            logs = "".join(p.read_text() for p in Path(tmp, "log").glob("*") if p.is_file())
            raise RuntimeError(f"{SYSTEMS[system]} failed:\n{done.stdout}{done.stderr}{logs}")
        return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rank", help=argparse.SUPPRESS)
    p.add_argument("--system", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank:
        rank_main(a.rank, a.system, a.steps)
        return
    results: dict[int, list[float]] = {s: [] for s in range(len(SYSTEMS))}
    for _ in range(a.rounds):
        for system in results:
            results[system].append(launch(system, a.steps))
    medians = {system: statistics.median(times) for system, times in results.items()}
    print(f"2 trainers + 2 servers, global batch 32, {a.steps} timed steps, {a.rounds} rounds")
    print(f"{'system':<34} {'step ms':>8} {'vs lb.ps, optimizer in the same place':>38}")
    for system, med in medians.items():
        ratio = med / medians[SAME_PLACE[system]]
        print(f"{SYSTEMS[system]:<34} {med * 1e3:>8.2f} {ratio:>37.2f}x")


if __name__ == "__main__":
    main()
