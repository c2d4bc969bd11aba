"""Training step time of ``Strategy(auto=True)`` (after its trial) against the defaults, same run.

    python benchmarks/auto_vs_default.py --rounds 10 --steps 5          # 2 local ranks
    longboat emulate --nodes 2 --nproc-per-node 1 --bandwidth 1gbit -- \\
        benchmarks/auto_vs_default.py --rounds 10 --steps 5

Every rank builds two identical models, one wrapped with ``lb.distribute`` and the default
Strategy, one with ``Strategy(auto=True)``. The auto model first runs its whole trial (every
candidate setting, logged on rank 0), the defaults get as many warm-up steps; then rounds of
``--steps`` steps alternate between the two, the order flipped each round (paired in time, so
machine noise hits both alike). Rank 0 prints the choice, both median step times and the median
of the per-round ratios auto/defaults as a Markdown table for docs/BENCHMARKS.md.
Run plainly (no RANK in the environment) it starts ``--nproc`` local ranks itself.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

WIDTHS = [512, 2048, 2048, 512, 10]  # 6.3 M parameters: 25 MB of float32 gradients
BATCH = 64  # per rank


def build() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(WIDTHS, WIDTHS[1:], strict=False):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def run_steps(model: Any, opt: torch.optim.Optimizer, x: Any, y: Any, steps: int) -> float:
    """Mean seconds per training step over ``steps`` steps, between barriers."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    dist.barrier()
    return (time.perf_counter() - start) / steps


def worker(rounds: int, steps: int) -> dict[str, Any]:
    import longboat as lb

    lb.init()
    torch.set_num_threads(1)
    torch.manual_seed(1 + lb.rank())
    x, y = torch.randn(BATCH, WIDTHS[0]), torch.randint(0, 10, (BATCH,))
    runs: dict[str, tuple[Any, torch.optim.Optimizer]] = {}
    for name, strategy in (("defaults", lb.Strategy()), ("auto", lb.Strategy(auto=True))):
        model = build()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        runs[name] = lb.distribute(model, opt, strategy)
    tuner = runs["auto"][0].tuner
    trial = tuner.trial_length + 1 if tuner is not None else 0  # decided at the next step
    for name in runs:  # the auto trial, and as many warm-up steps for the defaults
        run_steps(*runs[name], x, y, max(trial, 3))
    choice = tuner.choice.describe() if tuner is not None else "defaults (nothing to tune)"
    times: dict[str, list[float]] = {n: [] for n in runs}
    for r in range(rounds):
        for name in list(runs)[:: 1 if r % 2 == 0 else -1]:
            times[name].append(run_steps(*runs[name], x, y, steps))
    return {"times": times, "choice": choice, "trial": trial}


def report(result: dict[str, Any], rounds: int, steps: int) -> None:
    times = result["times"]
    base = times["defaults"]
    print(f"model: MLP {WIDTHS} (6.3 M parameters), batch {BATCH} per rank, SGD momentum 0.9")
    print(f"auto chose: {result['choice']} (trial: {result['trial']} steps)\n")
    print("| setting | step ms (median) | ratio to defaults (median of paired rounds) |")
    print("|---|---|---|")
    for name, samples in times.items():
        ratio = statistics.median(a / b for a, b in zip(samples, base, strict=True))
        print(f"| {name} | {1e3 * statistics.median(samples):.1f} | {ratio:.3f} |")
    print(f"\n{rounds} rounds x {steps} steps per setting")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2, help="local ranks when not launched")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if "RANK" in os.environ:  # started by a launcher: this process is one rank
        result = worker(args.rounds, args.steps)
        if int(os.environ["RANK"]) == 0:
            report(result, args.rounds, args.steps)
        return
    from longboat.launch.local import launch_local

    results = launch_local(worker, (args.rounds, args.steps), nproc=args.nproc)
    report(results[0], args.rounds, args.steps)


if __name__ == "__main__":
    main()
