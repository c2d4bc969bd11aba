"""Where a sharded step's time goes: forward, backward and ``optimizer.step()`` timed apart for
longboat unsharded and with sharding stage 1 and 2, on real Gloo ranks.

    python benchmarks/sharding_phases.py                 # 2 ranks, bench train's mlp
    python benchmarks/sharding_phases.py --nproc 4 --rounds 20

The three systems train the same model (bench train's ``mlp``: 6.3 M float32 parameters, SGD
with momentum, batch 64 per rank) in alternating rounds of ``--steps`` steps, each step
starting on a barrier; rank 0 prints each phase's median in ms over every timed step. Under
sharding the forward includes the wait for the parameters' all-gather (launched by the step
before), and the step only launches it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests._dist import run_ranks  # noqa: E402 - after the path tweak

SYSTEMS = {
    "longboat unsharded": {},
    "sharding stage 1": {"sharding": True, "sharding_configs": {"stage": 1}},
    "sharding stage 2": {"sharding": True, "sharding_configs": {"stage": 2}},
}
PHASES = ("forward", "backward", "step", "total")


def _rank(rank: int, world: int, rounds: int, steps: int) -> dict[str, dict[str, float]]:
    import longboat as lb
    from longboat.tools.bench.train_models import MODELS

    torch.set_num_threads(1)
    lb.init()
    spec = MODELS["mlp"]
    x = torch.randn(spec.batch, spec.arg[0], generator=torch.Generator().manual_seed(rank))
    y = torch.randint(0, spec.arg[-1], (spec.batch,), generator=torch.Generator().manual_seed(1))
    built = {}
    for name, fields in SYSTEMS.items():
        net = spec.build()  # seeded: the same weights on every rank
        built[name] = lb.distribute(
            net, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9), lb.Strategy(**fields)
        )
    times: dict[str, dict[str, list[float]]] = {n: {p: [] for p in PHASES} for n in SYSTEMS}
    for r in range(rounds + 2):  # two warm-up rounds
        for name, (model, opt) in built.items():
            for _ in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                loss = F.cross_entropy(model(x), y)
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
                opt.step()
                opt.zero_grad()
                t3 = time.perf_counter()
                if r >= 2:
                    for phase, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t3 - t0), strict=True):
                        times[name][phase].append(dt)
    lb.shutdown()
    return {n: {p: statistics.median(v) * 1e3 for p, v in t.items()} for n, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    rank0 = run_ranks(_rank, args.nproc, args.rounds, args.steps, timeout=1800)[0]
    print(f"{args.nproc} Gloo ranks, mlp, median ms of {args.rounds * args.steps} steps")
    print("| system | " + " | ".join(PHASES) + " |\n|---|" + "---|" * len(PHASES))
    for name, phases in rank0.items():
        print(f"| {name} | " + " | ".join(f"{phases[p]:.2f}" for p in PHASES) + " |")


if __name__ == "__main__":
    main()
