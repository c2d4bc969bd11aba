"""Resident memory over a long run with the timeline on, next to the same run with it off.

    python benchmarks/timeline_memory.py --steps 8000

Two Gloo ranks train a small MLP in 4 buckets on 2 communicators (many events per step, little
compute), once with ``Strategy(timeline=...)`` and once without, in the same invocation. Reported
per rank: RSS at step 500 and at the last step, growth in KB per step after step 500, wall time,
and the size of each rank's trace file (bytes per step).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests._dist import run_ranks  # noqa: E402 - after the path tweak

FIRST_MARK = 500


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _train(rank: int, world: int, trace: str | None, steps: int) -> tuple[float, float, float]:
    """(RSS MB at FIRST_MARK, RSS MB at the end, seconds) of ``steps`` training steps."""
    import longboat as lb

    strategy = lb.Strategy(timeline=trace, nccl_comm_num=2, fuse_grad_size_in_MB=0.001)
    lb.init(strategy)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )
    model, opt = lb.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    first, started = 0.0, time.perf_counter()
    for step, (xb, yb) in enumerate(lb.trace.data([(x, y)] * steps), 1):
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
        if step == FIRST_MARK:
            first = _rss_mb()
    return first, _rss_mb(), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8000)
    args = parser.parse_args()
    print(
        f"| timeline | rank | RSS at step {FIRST_MARK} -> {args.steps} (MB) | KB/step | "
        "wall (s) | trace bytes/step |"
    )
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for on in (False, True):
            trace = str(Path(tmp, "trace.json")) if on else None
            results = run_ranks(_train, 2, trace, args.steps, timeout=3600)
            for rank, (first, last, wall) in enumerate(results):
                growth = (last - first) * 1024 / (args.steps - FIRST_MARK)
                size = Path(tmp, f"trace.rank{rank}.json")
                per_step = f"{size.stat().st_size / args.steps:.0f}" if on else "-"
                print(
                    f"| {'on' if on else 'off'} | {rank} | {first:.1f} -> {last:.1f} | "
                    f"{growth:.2f} | {wall:.1f} | {per_step} |"
                )


if __name__ == "__main__":
    main()
